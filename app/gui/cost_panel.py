"""The cost panel: what each model costs per step, drawn to be compared at a glance.

- FLOPs per step (log axis), one line per model, gaps where a model was off;
- latency per step: a rolling median (5 s) with a light p10-p90 band per model (log axis);
- the front end's latency on its own axis (it is 10-100x a model step and would squash them),
  its title saying whether the musicnn push runs compiled or eager.

The time plots share their x axis (steps); the legend sits above the data, and clicking a
model's entry hides or shows all of that model's curves. Hovering a plot reads its values out.
"""
from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from .plot_kit import axis_plot, gapped, model_brush, model_pen, rolling_quantiles

ROLLING_STEPS = 20            # latency median / band over 20 hops (5 s)
FRONT = "front end"
FRONT_TITLE = "Front end latency per hop"


class ModelCurves:
    """One model's items: FLOPs line, latency median line and its p10-p90 band."""

    def __init__(self, panel: "CostPanel", name: str, index: int):
        self.index = index
        self.fresh = True                                 # its band not drawn yet
        self.flops = panel.flops_plot.plot(pen=model_pen(index), connect="finite")
        self.median = panel.latency_plot.plot(pen=model_pen(index), connect="finite")
        self.lo = pg.PlotDataItem(pen=None, connect="finite")
        self.hi = pg.PlotDataItem(pen=None, connect="finite")
        self.band = pg.FillBetweenItem(self.lo, self.hi, brush=model_brush(index))
        for item in (self.lo, self.hi, self.band):       # in the plot: its log mode applies to them
            panel.latency_plot.addItem(item)
        self.band.setZValue(-10)
        panel.legend.addItem(self.median, html.escape(name, quote=False))     # the legend draws HTML
        # the legend toggles the median line; the model's other items follow it
        self.median.visibleChanged.connect(self.follow)

    def follow(self) -> None:
        on = self.median.isVisible()
        for item in (self.flops, self.band):
            item.setVisible(on)

    def remove(self, panel: "CostPanel") -> None:
        panel.legend.removeItem(self.median)
        panel.flops_plot.removeItem(self.flops)
        panel.latency_plot.removeItem(self.median)
        for item in (self.lo, self.hi, self.band):
            panel.latency_plot.removeItem(item)


class CostPanel(QWidget):
    def __init__(self):
        super().__init__()
        col = QVBoxLayout(self)
        col.setContentsMargins(2, 2, 2, 2)
        row = QHBoxLayout()
        row.addWidget(QLabel("FLOPs of"))
        self.kind_box = QComboBox()
        for label, key in (("SDA", "sda"), ("attention (with projections)", "attention"),
                           ("whole model", "model")):
            self.kind_box.addItem(label, key)
        self.kind_box.currentIndexChanged.connect(lambda: setattr(self, "flops_kind", self.kind_box.currentData()))
        row.addWidget(self.kind_box)
        row.addStretch(1)
        col.addLayout(row)
        self.readout = QLabel("Hover a plot to read its values; wheel / drag to zoom and pan, "
                              "'A' to follow the data again; click a legend entry to hide a model.")
        self.readout.setWordWrap(True)
        self.readout.setStyleSheet("color:#333;")
        col.addWidget(self.readout)
        self.view = view = pg.GraphicsLayoutWidget()
        col.addWidget(view, 1)
        self.legend = pg.LegendItem(labelTextSize="8pt", colCount=3, verSpacing=-6)
        view.addItem(self.legend, row=0, col=0)
        self.flops_plot = axis_plot(view, 1, 0, "FLOPs per step", "FLOPs", log_y=True)
        self.latency_plot = axis_plot(view, 2, 0, "Latency: 5 s median, p10-p90 band", "ms", log_y=True)
        self.front_plot = axis_plot(view, 3, 0, FRONT_TITLE, "ms")
        self.push: str | None = None                        # how the front end's network runs: ``set_push``
        self.front_plot.setLabel("bottom", "step")
        for p in (self.latency_plot, self.front_plot):
            p.setXLink(self.flops_plot)                      # aligned, whatever joins or leaves
        self.front_median = self.front_plot.plot(pen=pg.mkPen("#555", width=2), connect="finite")
        self.front_lo = pg.PlotDataItem(pen=None)
        self.front_hi = pg.PlotDataItem(pen=None)
        for item in (self.front_lo, self.front_hi,
                     pg.FillBetweenItem(self.front_lo, self.front_hi, brush=(120, 120, 120, 50))):
            self.front_plot.addItem(item)
        self.front_flops = None                             # its FLOPs, in the 'whole model' view
        for row, stretch in ((0, 0), (1, 3), (2, 3), (3, 2)):
            view.ci.layout.setRowStretchFactor(row, stretch)
        self.curves: dict[str, ModelCurves] = {}
        self.flops_kind = "sda"
        self.series: tuple = (np.array([]), {}, None)       # what the read-out reads
        view.scene().sigMouseMoved.connect(self.hover)

    def set_push(self, words: str | None) -> None:
        """How the front end's network runs (the front end's ``push_status``): short in the
        front-end plot's title, whole in its tool tip."""
        self.push = words
        short = ("" if words is None else " (compiled)" if words.startswith("compiled")
                 else " (eager, compiling)" if words.startswith("eager while") else " (eager)")
        self.front_plot.setTitle(FRONT_TITLE + short)
        self.front_plot.setToolTip(words or "")

    def save(self, settings) -> None:
        settings.setValue("cost/flops_kind", self.flops_kind)

    def restore(self, settings) -> None:
        self.kind_box.setCurrentIndex(max(self.kind_box.findData(settings.value("cost/flops_kind", "sda")), 0))

    # ------------------------------------------------------------------ drawing
    def redraw(self, recent: list, models: list[str], bands: bool = True) -> None:
        """Redraw from ``recent`` (StepResults, oldest first; two minutes at most). ``bands``:
        the p10-p90 bands too (their fills are the dearest items to update: the window does it
        once a second, the lines on every frame)."""
        if not recent:
            return
        steps = np.array([r.step for r in recent])
        series = {}
        for i, name in enumerate(models):
            rows = [(r.step, r.models[name].flops[self.flops_kind], r.models[name].latency_ms)
                    for r in recent if name in r.models]
            if not rows:
                continue
            s, f, lat = map(np.array, zip(*rows))
            flops, lat = gapped(s, np.maximum(f, 1), steps), gapped(s, np.maximum(lat, 1e-3), steps)
            q = rolling_quantiles(lat, ROLLING_STEPS)
            c = self.curves.get(name)
            if c is None or c.index != i:
                if c is not None:
                    c.remove(self)
                c = self.curves[name] = ModelCurves(self, name, i)
            c.flops.setData(steps, flops)
            c.median.setData(steps, q[1])
            if bands or c.fresh:
                c.lo.setData(steps, q[0])
                c.hi.setData(steps, q[2])
                c.fresh = False
            series[name] = (flops, q)
        for name in [n for n in self.curves if n not in models]:
            self.curves.pop(name).remove(self)
        front = np.array([r.stages["frontend"] for r in recent])
        fq = rolling_quantiles(front, ROLLING_STEPS)
        self.front_median.setData(steps, fq[1])
        if bands:
            self.front_lo.setData(steps, fq[0])
            self.front_hi.setData(steps, fq[2])
        self._front_flops(recent, steps)
        self.series = (steps, series, fq)

    def _front_flops(self, recent: list, steps: np.ndarray) -> None:
        """In the 'whole model' view, the front end's FLOPs per hop beside the models'."""
        if self.flops_kind == "model":
            if self.front_flops is None:
                self.front_flops = self.flops_plot.plot(pen=pg.mkPen("#555", width=2, style=Qt.DashLine))
                self.legend.addItem(self.front_flops, f"{FRONT} (FLOPs)")
            self.front_flops.setData(steps, np.maximum([r.frontend_flops for r in recent], 1).astype(float))
        elif self.front_flops is not None:
            self.legend.removeItem(self.front_flops)
            self.flops_plot.removeItem(self.front_flops)
            self.front_flops = None

    # ------------------------------------------------------------------ read-out
    def hover(self, pos) -> None:
        """The values under the mouse, in the read-out line."""
        for plot in (self.flops_plot, self.latency_plot, self.front_plot):
            if plot.sceneBoundingRect().contains(pos):
                self.readout.setText(self.readout_at(plot.vb.mapSceneToView(pos).x()))
                return

    def readout_at(self, x: float) -> str:
        """'step S: front end 12.1 ms · name 0.21 ms, 9,280 FLOPs · ...' at the step nearest ``x``."""
        steps, series, fq = self.series
        if not len(steps):
            return ""
        i = int(np.clip(np.searchsorted(steps, round(x)), 0, len(steps) - 1))
        parts = [f"step {steps[i]}: {FRONT} {fq[1][i]:.1f} ms"]
        for name, (flops, q) in series.items():
            if np.isfinite(flops[i]):
                parts.append(f"{name} {q[1][i]:.2f} ms (p10-p90 {q[0][i]:.2f}-{q[2][i]:.2f}), "
                             f"{int(flops[i]):,} FLOPs")
        return " · ".join(parts)
