"""Live plots (pyqtgraph): genre bars, probability history, per-step FLOPs and latency, log-mel.

``LivePlots.redraw(history, focus, models)`` redraws from the GUI thread's ring of StepResults; it is called at a
bounded rate (the window's frame timer), never once per result.
"""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

from audio.gtzan import GENRES
from audio.melspec import HOPS_PER_MINUTE

MODEL_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf"]
GENRE_COLOURS = [pg.intColor(i, hues=10, values=1, maxValue=230) for i in range(10)]
SPEC_FRAMES = 1000            # 10 s of log-mel frames (100 per second)


def _axis_plot(layout, row, col, title, left, log_y=False, **kw):
    p = layout.addPlot(row=row, col=col, title=title, **kw)
    p.setLabel("left", left)
    p.showGrid(x=True, y=True, alpha=0.25)
    if log_y:
        p.setLogMode(y=True)
    p.setMouseEnabled(x=False, y=False)
    p.hideButtons()
    return p


class LivePlots(pg.GraphicsLayoutWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setBackground("w")
        pg.setConfigOptions(antialias=False, foreground="k")
        self.bars_plot = _axis_plot(self, 0, 0, "Genre probabilities (focused model)", "p")
        self.bars = pg.BarGraphItem(x=np.arange(10), height=np.zeros(10), width=0.7,
                                    brushes=GENRE_COLOURS)
        self.bars_plot.addItem(self.bars)
        self.bars_plot.setYRange(0, 1)
        self.bars_plot.getAxis("bottom").setTicks([[(i, g[:5]) for i, g in enumerate(GENRES)]])
        self.history_plot = _axis_plot(self, 0, 1, "Probability history, last minute (focused model)", "p")
        self.history_plot.setYRange(0, 1)
        self.history_plot.setLabel("bottom", "audio time (s)")
        self.history_plot.addLegend(offset=(-5, 5), labelTextSize="7pt", colCount=2)
        self.history = [self.history_plot.plot(pen=pg.mkPen(GENRE_COLOURS[i], width=1.5), name=g)
                        for i, g in enumerate(GENRES)]
        self.flops_plot = _axis_plot(self, 1, 0, "FLOPs per step (log)", "FLOPs", log_y=True)
        self.flops_plot.setLabel("bottom", "step")
        self.flops_plot.addLegend(offset=(-5, 5), labelTextSize="7pt")
        self.latency_plot = _axis_plot(self, 1, 1, "Latency per step (log)", "ms", log_y=True)
        self.latency_plot.setLabel("bottom", "step")
        self.latency_plot.addLegend(offset=(-5, 5), labelTextSize="7pt")
        self.spec_plot = _axis_plot(self, 2, 0, "Log-mel spectrogram (the tokens' input), last 10 s", "mel band",
                                    colspan=2)
        self.spec = pg.ImageItem(axisOrder="row-major")
        self.spec.setColorMap(pg.colormap.get("viridis"))
        self.spec_plot.addItem(self.spec)
        self.set_spectrogram(64, (-7.0, 3.0), 10)
        self.ci.layout.setRowStretchFactor(2, 0)
        self.flops_curves: dict[str, pg.PlotDataItem] = {}
        self.latency_curves: dict[str, pg.PlotDataItem] = {}
        self.flops_kind = "sda"

    def set_spectrogram(self, bands: int, levels: tuple[float, float], frame_ms: float) -> None:
        """Shape the spectrogram for a front end's log-mel: bands, colour levels, frame period."""
        self.spec_levels = levels
        self.spec_data = np.full((bands, SPEC_FRAMES), levels[0] - 3.0, dtype=np.float32)   # "no data yet"
        self.spec_plot.setLabel("bottom", f"frame ({frame_ms:g} ms)")

    def _curve(self, store, plot, name, index, style=Qt.SolidLine):
        if name not in store:
            store[name] = plot.plot(pen=pg.mkPen(MODEL_COLOURS[index % 10], width=1.5, style=style),
                                    name=name)
        return store[name]

    def drop_model(self, name: str) -> None:
        for store, plot in ((self.flops_curves, self.flops_plot), (self.latency_curves, self.latency_plot)):
            if name in store:
                plot.removeItem(store.pop(name))
                plot.legend.removeItem(name)

    def push_mel(self, frames: np.ndarray) -> None:
        """frames: (k, bands) new log-mel frames of one hop."""
        k = frames.shape[0]
        self.spec_data = np.roll(self.spec_data, -k, axis=1)
        self.spec_data[:, -k:] = frames.T

    def redraw(self, history: list, focus: str | None, models: list[str]) -> None:
        """Redraw from ``history`` (StepResults, oldest first, at most a few minutes)."""
        if not history:
            return
        last = history[-1]
        if focus in last.models:
            self.bars.setOpts(height=np.array(last.models[focus].probabilities))
            minute = [r for r in history[-HOPS_PER_MINUTE:] if focus in r.models]
            t = np.array([r.audio_time for r in minute])
            P = np.array([r.models[focus].probabilities for r in minute])
            for i, c in enumerate(self.history):
                c.setData(t, P[:, i])
        recent = history[-2 * HOPS_PER_MINUTE:]
        steps = np.array([r.step for r in recent])
        for i, name in enumerate(models):
            rows = [(r.step, r.models[name].flops[self.flops_kind], r.models[name].latency_ms)
                    for r in recent if name in r.models]
            if not rows:
                continue
            s, f, lat = map(np.array, zip(*rows))
            self._curve(self.flops_curves, self.flops_plot, name, i).setData(s, np.maximum(f, 1))
            self._curve(self.latency_curves, self.latency_plot, name, i).setData(s, np.maximum(lat, 1e-3))
        front = np.array([r.stages["frontend"] for r in recent])
        self._curve(self.latency_curves, self.latency_plot, "front end", 9,
                    Qt.DashLine).setData(steps, np.maximum(front, 1e-3))
        if self.flops_kind == "model":        # whole-model view: the front end's cost beside them
            ff = np.array([r.frontend_flops for r in recent], dtype=float)
            self._curve(self.flops_curves, self.flops_plot, "front end", 9,
                        Qt.DashLine).setData(steps, np.maximum(ff, 1))
        elif "front end" in self.flops_curves:
            self.flops_plot.removeItem(self.flops_curves.pop("front end"))
            self.flops_plot.legend.removeItem("front end")
        for name in list(self.flops_curves):
            if name not in models and name != "front end":
                self.drop_model(name)
        self.spec.setImage(self.spec_data, autoLevels=False, levels=self.spec_levels)
