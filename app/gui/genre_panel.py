"""The genre panel: what the focused model hears, now and over the last two minutes.

- bars of the newest probabilities, genre names in full (a checkpoint of more than MAX_BARS
  classes of its own: its MAX_BARS most probable classes of the newest step);
- a scrolling genre timeline: one strip for each step's top genre and one for the smoothed genre
  (the big label's), coloured as the bars, with the genre named on every stretch of 4 s or more;
- the probability of each genre drawn in the bars over the last minute (colours as in the bars:
  a class's colour is its index's, repeating past ten classes).
"""
from __future__ import annotations

from collections import deque

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from audio.gtzan import GENRES
from audio.melspec import HOP_SECONDS, HOPS_PER_MINUTE

from .plot_kit import GENRE_COLOURS, axis_plot, gapped

TIMELINE_STEPS = 2 * HOPS_PER_MINUTE      # two minutes of steps
NAMED_RUN = 16                            # a smoothed stretch of 16 steps (4 s) gets its name
MAX_BARS = len(GENRE_COLOURS)             # classes the bars and the history draw at once


GENRE_RGBA = np.array([c.getRgb() for c in GENRE_COLOURS], dtype=np.uint8)   # (10, 4)


def drawn_classes(probabilities) -> tuple[int, ...]:
    """The class indices the bars draw: every class up to MAX_BARS, else the MAX_BARS most
    probable, in class order."""
    p = np.asarray(probabilities)
    if len(p) <= MAX_BARS:
        return tuple(range(len(p)))
    return tuple(sorted(np.argpartition(-p, MAX_BARS - 1)[:MAX_BARS].tolist()))


def runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, stop, value) of each run of equal values in ``values`` (1-D)."""
    if not len(values):
        return []
    edges = np.flatnonzero(np.diff(values)) + 1
    starts, stops = np.r_[0, edges], np.r_[edges, len(values)]
    return [(int(a), int(b), int(values[a])) for a, b in zip(starts, stops)]


class GenrePanel(QWidget):
    def __init__(self):
        super().__init__()
        col = QVBoxLayout(self)
        col.setContentsMargins(2, 2, 2, 2)
        self.readout = QLabel("Hover the timeline or the history to read the genre at a time.")
        self.readout.setStyleSheet("color:#333;")
        col.addWidget(self.readout)
        self.view = view = pg.GraphicsLayoutWidget()
        col.addWidget(view, 1)
        self.bars_plot = axis_plot(view, 0, 0, "Now", "", rowspan=2, left_px=70)
        self.bars_plot.getAxis("left").setTicks([list(enumerate(GENRES))])
        self.bars_plot.invertY(True)
        self.bars_plot.setXRange(0, 1, padding=0)
        self.bars_plot.getAxis("bottom").setTicks([[(0, "0"), (0.5, "0.5"), (1, "1")]])
        self.bars_plot.setYRange(-0.6, 9.6, padding=0)
        self.bars_plot.setMouseEnabled(x=False, y=False)
        self.bars = pg.BarGraphItem(x0=np.zeros(10), y=np.arange(10), height=0.7, width=np.zeros(10),
                                    brushes=GENRE_COLOURS)
        self.bars_plot.addItem(self.bars)
        self.timeline_plot = axis_plot(view, 0, 1, "Genre timeline", "", left_px=70)
        self.timeline_plot.getAxis("left").setTicks([[(0.5, "smoothed"), (1.5, "step")]])
        self.timeline_plot.setYRange(0, 2, padding=0)
        self.timeline_plot.setMouseEnabled(x=True, y=False)
        self.timeline = pg.ImageItem(axisOrder="row-major")
        self.timeline_plot.addItem(self.timeline)
        self.names: list[pg.TextItem] = []            # genre names on the smoothed strip
        self.history_plot = axis_plot(view, 1, 1, "Probabilities, last minute", "p", left_px=70)
        self.history_plot.setYRange(0, 1)
        self.history_plot.setLabel("bottom", "audio time (s)")
        self.history_plot.setXLink(self.timeline_plot)
        self.history = [self.history_plot.plot(pen=pg.mkPen(GENRE_COLOURS[i], width=1.5), connect="finite")
                        for i in range(10)]
        view.ci.layout.setColumnStretchFactor(0, 1)
        view.ci.layout.setColumnStretchFactor(1, 3)
        view.ci.layout.setRowStretchFactor(0, 1)
        view.ci.layout.setRowStretchFactor(1, 2)
        # per model: (step, audio time, top genre, smoothed top genre) of its recent steps
        self.tracks: dict[str, deque] = {}
        self.shown: tuple = ((), None)                # (track rows drawn, classes) for the read-out
        self.drawn: tuple = (tuple(GENRES), tuple(range(10)))   # (classes, indices) the bars draw
        view.scene().sigMouseMoved.connect(self.hover)

    def push(self, result, smoothed: dict[str, list[float]]) -> None:
        """Record every model's top and smoothed top genre for one StepResult."""
        for name, m in result.models.items():
            s = smoothed.get(name, m.probabilities)
            track = self.tracks.setdefault(name, deque(maxlen=TIMELINE_STEPS))
            track.append((result.step, result.audio_time, int(np.argmax(m.probabilities)), int(np.argmax(s))))

    def reset(self) -> None:
        self.tracks.clear()

    def redraw(self, recent: list, focus: str | None) -> None:
        """Redraw for the focused model from ``recent`` (StepResults, oldest first)."""
        if not recent or focus not in recent[-1].models:
            return
        m = recent[-1].models[focus]
        drawn = (tuple(m.classes), drawn_classes(m.probabilities))
        if drawn != self.drawn:                      # a checkpoint with its own classes
            self._draw_classes(*drawn)
        index = list(drawn[1])
        self.bars.setOpts(width=np.asarray(m.probabilities)[index])
        minute = recent[-HOPS_PER_MINUTE:]
        steps = np.array([r.step for r in minute])
        times = np.array([r.audio_time for r in minute])
        rows = [(r.step, r.models[focus].probabilities) for r in minute
                if focus in r.models and len(r.models[focus].probabilities) == len(m.classes)]
        s, P = np.array([a for a, _ in rows]), np.array([p for _, p in rows]).reshape(len(rows), -1)
        for j, c in enumerate(self.history):
            c.setData(times, gapped(s, P[:, index[j]], steps) if j < len(index) else np.full(len(steps), np.nan))
        self._timeline(self.tracks.get(focus, ()), m.classes, recent[-1].step)

    def _draw_classes(self, classes: tuple, index: tuple) -> None:
        """Bars, ticks and history pens for the classes ``index`` of ``classes``."""
        self.drawn = (classes, index)
        k = len(index)
        self.bars.setOpts(x0=np.zeros(k), y=np.arange(k), width=np.zeros(k),
                          brushes=[GENRE_COLOURS[i % len(GENRE_COLOURS)] for i in index])
        self.bars_plot.getAxis("left").setTicks([[(j, classes[i]) for j, i in enumerate(index)]])
        self.bars_plot.setYRange(-0.6, max(k, 1) - 0.4, padding=0)
        for j, c in enumerate(self.history):
            if j < k:
                c.setPen(pg.mkPen(GENRE_COLOURS[index[j] % len(GENRE_COLOURS)], width=1.5))

    def _timeline(self, track, classes, last_step: int) -> None:
        """The two strips over the last TIMELINE_STEPS steps; steps without ``track`` rows are blank."""
        rows = [t for t in track if t[0] > last_step - TIMELINE_STEPS]
        self.shown = (rows, classes)
        if not rows:
            return
        first = rows[0][0]
        width = last_step - first + 1
        steps, tops, smoothed = (np.array(c, dtype=int) for c in zip(*((r[0], r[2], r[3]) for r in rows)))
        image = np.zeros((2, width, 4), dtype=np.uint8)         # steps without a row: transparent
        image[1, steps - first] = GENRE_RGBA[tops % len(GENRE_RGBA)]
        image[0, steps - first] = GENRE_RGBA[smoothed % len(GENRE_RGBA)]
        smooth = np.full(width, -1)
        smooth[steps - first] = smoothed
        t0 = rows[0][1] - HOP_SECONDS
        self.timeline.setImage(image, autoLevels=False)
        self.timeline.setRect(QRectF(t0, 0, width * HOP_SECONDS, 2))
        named = [(a, b, g) for a, b, g in runs(smooth) if g >= 0 and b - a >= NAMED_RUN]
        while len(self.names) < len(named):
            item = pg.TextItem(anchor=(0.5, 0.5), color="k")
            self.timeline_plot.addItem(item)
            self.names.append(item)
        for item, (a, b, g) in zip(self.names, named):
            item.setText(classes[g])
            item.setPos(t0 + (a + b) / 2 * HOP_SECONDS, 0.5)
            item.show()
        for item in self.names[len(named):]:
            item.hide()

    def hover(self, pos) -> None:
        for plot in (self.timeline_plot, self.history_plot):
            if plot.sceneBoundingRect().contains(pos):
                self.readout.setText(self.readout_at(plot.vb.mapSceneToView(pos).x()))
                return

    def readout_at(self, t: float) -> str:
        """'12.3 s: step rock, smoothed blues' for the focused model's step nearest ``t``."""
        rows, classes = self.shown
        if not rows:
            return ""
        i = int(np.argmin([abs(r[1] - t) for r in rows]))
        _, time, top, sm = rows[i]
        return f"{time:.2f} s: this step {classes[top]}, smoothed {classes[sm]}"
