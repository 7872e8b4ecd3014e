"""The ranking panel: each model's mean FLOPs per step and mean latency over the last minute as
bars, cheapest (fewest FLOPs) on top, coloured as its curves, both charts in the same order:
which variant is cheaper, and whether its latency follows its FLOPs, without reading numbers."""
from __future__ import annotations

import statistics

import numpy as np
import pyqtgraph as pg

from audio.melspec import HOPS_PER_MINUTE

from .plot_kit import MODEL_COLOURS, axis_plot, log_ticks
from .table import same_mode_run


def bar_values(minute: list, models: list[str], flops_kind: str) -> dict[str, tuple[float, float]]:
    """Per running model: (mean latency in ms over ``minute``, mean ``flops_kind`` FLOPs per step
    over its steps since its last landmark switch, past warm-up: the table's FLOPs mean)."""
    last, out = minute[-1], {}
    for name in models:
        if name in last.models:
            lat = [r.models[name].latency_ms for r in minute if name in r.models]
            run = same_mode_run(minute, name)
            out[name] = (statistics.fmean(lat), statistics.fmean(m.flops[flops_kind] for m in run))
    return out


class RankingPanel(pg.GraphicsLayoutWidget):
    def __init__(self):
        super().__init__()
        self.flops_plot = axis_plot(self, 0, 0, "Mean FLOPs/step, last minute", "", left_px=150)
        self.latency_plot = axis_plot(self, 0, 1, "Mean latency (ms)", "", left_px=8)
        self.latency_plot.getAxis("left").setStyle(showValues=False)         # the names are on the left
        self.items = {}
        for p in (self.latency_plot, self.flops_plot):
            p.invertY(True)
            p.setMouseEnabled(x=False, y=False)
            p.hideButtons()
            self.items[p] = pg.BarGraphItem(x0=[], y=[], height=0.6, width=[])
            p.addItem(self.items[p])
        self.order: list[str] = []                   # model names, top to bottom (fewest FLOPs first)

    def redraw(self, recent: list, models: list[str], flops_kind: str) -> None:
        if not recent:
            return
        values = bar_values(recent[-HOPS_PER_MINUTE:], models, flops_kind)
        colour = {n: MODEL_COLOURS[models.index(n) % 10] for n in values}
        order = self.order = sorted(values, key=lambda n: values[n][1])        # fewest FLOPs on top
        for key, plot, log in ((0, self.latency_plot, False), (1, self.flops_plot, True)):
            v = np.array([values[n][key] for n in order], dtype=float)
            if log:
                v = np.log10(np.maximum(v, 1))
            base = np.floor(v.min()) - 1 if log and len(v) else 0.0
            self.items[plot].setOpts(x0=np.full(len(v), base), y=np.arange(len(v)), width=v - base,
                                     brushes=[colour[n] for n in order])
            plot.getAxis("left").setTicks([[(i, n) for i, n in enumerate(order)]])
            if len(v):
                if log:
                    plot.getAxis("bottom").setTicks([log_ticks(base, np.ceil(v.max()))])
                plot.setXRange(base, np.ceil(v.max()) if log else v.max() * 1.05, padding=0.02)
            plot.setYRange(-0.6, max(len(v), 1) - 0.4, padding=0)
