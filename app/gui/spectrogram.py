"""The spectrogram panel: the front end's log-mel input over the last 10 s, newest on the right."""
from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF

from .plot_kit import axis_plot

SPEC_SECONDS = 10.0


class SpectrogramPanel(pg.GraphicsLayoutWidget):
    def __init__(self):
        super().__init__()
        self.plot = axis_plot(self, 0, 0, "Log-mel spectrogram (the tokens' input), last 10 s", "mel band")
        self.plot.setLabel("bottom", "seconds before now")
        self.plot.setMouseEnabled(x=False, y=False)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setColorMap(pg.colormap.get("viridis"))
        self.plot.addItem(self.image)
        self.set_spectrogram(64, (-7.0, 3.0), 10)

    def set_spectrogram(self, bands: int, levels: tuple[float, float], frame_ms: float) -> None:
        """Shape for a front end's log-mel: bands, colour levels, frame period (ms)."""
        self.levels = levels
        frames = int(round(SPEC_SECONDS * 1000 / frame_ms))
        self.data = np.full((bands, frames), levels[0] - 3.0, dtype=np.float32)   # "no data yet"
        self.image.setRect(QRectF(-SPEC_SECONDS, 0, SPEC_SECONDS, bands))

    def push_mel(self, frames: np.ndarray) -> None:
        """frames: (k, bands) new log-mel frames of one hop."""
        k = min(frames.shape[0], self.data.shape[1])
        self.data = np.roll(self.data, -k, axis=1)
        self.data[:, -k:] = frames[-k:].T

    def redraw(self) -> None:
        self.image.setImage(self.data, autoLevels=False, levels=self.levels)
