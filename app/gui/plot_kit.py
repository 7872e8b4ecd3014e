"""Small pyqtgraph helpers shared by the panels: colours and pens per model, plots with mouse
zoom/pan and aligned axes, series with gaps left as gaps, rolling quantiles."""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

MODEL_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf"]
# dash patterns cycle with the colours so that two models of equal cost stay visible on one line
MODEL_STYLES = [Qt.SolidLine, Qt.DashLine, Qt.DotLine, Qt.DashDotLine]
GENRE_COLOURS = [pg.intColor(i, hues=10, values=1, maxValue=230) for i in range(10)]
LEFT_AXIS_PX = 58             # every plot's left axis has this width, so stacked plots align

pg.setConfigOptions(antialias=False, foreground="k", background="w")


def model_pen(index: int, width: float = 2.0) -> pg.QtGui.QPen:
    return pg.mkPen(MODEL_COLOURS[index % 10], width=width, style=MODEL_STYLES[index % 4])


def model_brush(index: int, alpha: int = 50) -> pg.QtGui.QBrush:
    colour = pg.mkColor(MODEL_COLOURS[index % 10])
    colour.setAlpha(alpha)
    return pg.mkBrush(colour)


def short_number(v: float) -> str:
    """12000 -> '12k', 2e6 -> '2M', 0.5 -> '0.5'."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:g}{suffix}"
    return f"{v:g}"


class LogAxis(pg.AxisItem):
    """A log axis whose labels never overlap: 1-2-5 steps, or decades, or every other decade,
    whichever is densest with one label per 14 px; labels as '2k', '10M', '0.5'."""

    def tickValues(self, lo, hi, size):  # noqa: N802 - pyqtgraph API
        if not self.logMode:
            return super().tickValues(lo, hi, size)
        most = max(2, int(size / 14))
        decades = range(int(np.floor(lo)) - 1, int(np.ceil(hi)) + 1)
        for mantissas, every in (((1, 2, 5), 1), ((1,), 1), ((1,), 2), ((1,), 3)):
            values = [k + np.log10(m) for k in decades if k % every == 0 for m in mantissas]
            values = [v for v in values if lo <= v <= hi]
            if 2 <= len(values) <= most or (len(values) < 2 and mantissas != (1,)):
                break
        return [(1.0, values)] if len(values) >= 2 else super().tickValues(lo, hi, size)

    def tickStrings(self, values, scale, spacing):  # noqa: N802 - pyqtgraph API
        if not self.logMode:
            return super().tickStrings(values, scale, spacing)
        return [short_number(float(f"{10 ** v:.3g}")) for v in values]


def axis_plot(layout, row: int, col: int, title: str, left: str, log_y: bool = False,
              left_px: int = LEFT_AXIS_PX, **kw):
    """A plot in ``layout`` with a fixed-width left axis, grid, curves clipped to the view and
    downsampled to its width, and pyqtgraph's mouse zoom / pan
    (wheel, drag; the 'A' button or a double right click returns to following the data).
    Keep ``title`` short: a plot is never narrower than its title."""
    if log_y:
        kw["axisItems"] = {"left": LogAxis("left")}
    p = layout.addPlot(row=row, col=col, title=title, **kw)
    p.setLabel("left", left)
    p.getAxis("left").setWidth(left_px)
    p.showGrid(x=True, y=True, alpha=0.25)
    if log_y:
        p.setLogMode(y=True)
    p.getAxis("left").enableAutoSIPrefix(False)
    p.getAxis("bottom").enableAutoSIPrefix(False)
    p.setMouseEnabled(x=True, y=True)
    p.setClipToView(True)                          # curves: only the points in view are drawn,
    p.setDownsampling(auto=True, mode="peak")      # at most about one per pixel column
    return p


def gapped(steps: np.ndarray, values: np.ndarray, all_steps: np.ndarray) -> np.ndarray:
    """``values`` at ``steps`` laid out over ``all_steps`` (sorted), NaN where a step is missing:
    drawn with connect='finite', a model that was off leaves a gap, not a line across it."""
    out = np.full(len(all_steps), np.nan)
    out[np.searchsorted(all_steps, steps)] = values
    return out


def rolling_quantiles(x: np.ndarray, window: int, qs=(10, 50, 90)) -> np.ndarray:
    """(len(qs), N) rolling percentiles of ``x`` (N,) over the last ``window`` values (fewer at
    the start), NaNs ignored, interpolated linearly as numpy's; NaN where ``x`` is NaN (a gap
    stays a gap). One sort of the (N, window) windows, two orders of magnitude faster than
    np.nanpercentile (docs/benchmarks.md, design measurements); it runs per model at the frame
    rate."""
    padded = np.concatenate([np.full(window - 1, np.nan), x.astype(float)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, window)
    ordered = np.sort(windows, axis=1)                          # NaNs sort last
    count = window - np.isnan(windows).sum(axis=1)              # values in each window
    out = np.full((len(qs), len(x)), np.nan)
    rows = np.flatnonzero((count > 0) & ~np.isnan(x))
    k = count[rows]
    for j, q in enumerate(qs):
        pos = q / 100 * (k - 1)
        lo = np.floor(pos).astype(int)
        hi = np.minimum(lo + 1, k - 1)
        a, b = ordered[rows, lo], ordered[rows, hi]
        out[j, rows] = a + (b - a) * (pos - lo)
    return out


def log_ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    """Ticks at powers of ten between 10**lo and 10**hi for an axis of log10 values: '1k', '10M'."""
    return [(k, short_number(10.0 ** k)) for k in range(int(np.floor(lo)), int(np.ceil(hi)) + 1)]
