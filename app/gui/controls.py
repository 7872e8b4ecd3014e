"""The side panel's widgets: source, models and export. Built here, wired by the window."""
from __future__ import annotations

from pathlib import Path

import torch
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QButtonGroup, QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout,
                               QGroupBox, QHBoxLayout, QLabel, QPushButton, QRadioButton, QSpinBox,
                               QVBoxLayout, QWidget)

from app.runtime.sources import SourceKind
from audio.errors import AudioError
from audio.frontends import FRONTENDS
from audio.sources import SPEEDS
from models.sda import VARIANTS

FRONTEND_LABELS = {"musicnn": "musicnn (pretrained, ships)", "vggish": "VGGish (the paper's)"}


class SidePanel(QWidget):
    """Source, model and export controls (no logic: the window connects their signals)."""

    def __init__(self):
        super().__init__()
        col = QVBoxLayout(self)
        col.addWidget(self._source_box())
        col.addWidget(self._models_box())
        exp = QGroupBox("Export")
        h = QHBoxLayout(exp)
        self.csv_btn, self.png_btn = QPushButton("Steps → CSV…"), QPushButton("Plots → PNG…")
        h.addWidget(self.csv_btn)
        h.addWidget(self.png_btn)
        col.addWidget(exp)
        col.addStretch(1)

    def _source_box(self) -> QGroupBox:
        src = QGroupBox("Source")
        f = QFormLayout(src)
        self.source_kind = QComboBox()
        for kind in SourceKind:
            self.source_kind.addItem(kind.label, kind.value)   # Qt keeps plain strings
        f.addRow("Input", self.source_kind)
        self.device_box = QComboBox()
        self.device_box.setToolTip("input devices PortAudio reports on this machine")
        f.addRow("Device", self.device_box)
        self.rescan_btn = QPushButton("Rescan devices")
        f.addRow("", self.rescan_btn)
        self.file_label = QLabel("no file (open one, or drop it on the window)")
        self.file_label.setWordWrap(True)
        self.open_btn = QPushButton("Open file…")
        f.addRow("File", self.open_btn)
        f.addRow(self.file_label)                  # a row of its own: a long name never squeezes the button
        self.loop_box = QCheckBox("Loop file")
        f.addRow("", self.loop_box)
        self.speed_box = QComboBox()
        for speed in SPEEDS:
            self.speed_box.addItem(f"{speed:g}x", speed)
        self.speed_box.setCurrentIndex(SPEEDS.index(1.0))
        self.speed_box.setToolTip("playback speed of a file or the demo signal, live (a microphone plays "
                                  "at its own); a hop the models cannot keep up with is dropped and counted")
        f.addRow("Speed", self.speed_box)
        self.compute_box = QComboBox()
        self.compute_box.addItem("CPU", "cpu")
        if torch.cuda.is_available():
            self.compute_box.addItem(f"CUDA ({torch.cuda.get_device_name(0)})", "cuda")
        f.addRow("Compute", self.compute_box)
        self.frontend_box = QComboBox()
        for name in FRONTENDS:
            self.frontend_box.addItem(FRONTEND_LABELS[name], name)
        self.frontend_box.setToolTip("token front end; models run only on the tokens they were trained on")
        f.addRow("Front end", self.frontend_box)
        buttons = QHBoxLayout()
        self.start_btn, self.pause_btn, self.stop_btn = (QPushButton(t) for t in ("Start", "Pause", "Stop"))
        self.pause_btn.setToolTip("Pause / resume the source (Ctrl+P)")
        for b in (self.start_btn, self.pause_btn, self.stop_btn):
            buttons.addWidget(b)
        f.addRow(buttons)
        return src

    def _models_box(self) -> QGroupBox:
        mod = QGroupBox("Models (side by side)")
        f = QFormLayout(mod)
        self.variant_boxes = {}
        for v in VARIANTS:
            box = QCheckBox(v)
            box.setToolTip("trained (shipped) model when one exists for the front end, else untrained")
            self.variant_boxes[v] = box
            f.addRow(box)
        self.layers_box = QSpinBox(minimum=1, maximum=2, value=1)
        self.window_box = QSpinBox(minimum=4, maximum=1920, value=120)
        self.window_box.setSuffix(" tokens")
        self.landmarks_box = QSpinBox(minimum=1, maximum=64, value=4)
        f.addRow("Blocks", self.layers_box)
        f.addRow("Window n", self.window_box)
        f.addRow("Landmarks m", self.landmarks_box)
        self.apply_btn = QPushButton("Apply shape (untrained models only)")
        f.addRow(self.apply_btn)
        lm = QHBoxLayout()
        self.mode_group = QButtonGroup(self)
        self.mode_continual, self.mode_fixed = QRadioButton("as trained"), QRadioButton("all fixed")
        self.mode_continual.setToolTip("each model's own landmarks: continual (stream segment means), "
                                       "or the k-means ones a fixed-landmark model was trained with")
        self.mode_fixed.setToolTip("every Nyström model on fixed landmarks; a model without them gets "
                                   "k-means landmarks of its Q/K on the last 480 stream tokens")
        self.mode_continual.setChecked(True)
        for i, b in enumerate((self.mode_continual, self.mode_fixed)):
            self.mode_group.addButton(b, i)
            lm.addWidget(b)
        f.addRow("Landmarks (live)", lm)
        self.reset_btn = QPushButton("Reset model states (empty windows)")
        f.addRow(self.reset_btn)
        self.checkpoint_btn = QPushButton("Load checkpoint…")
        f.addRow(self.checkpoint_btn)
        self.focus_box = QComboBox()
        f.addRow("Focus", self.focus_box)
        self.smooth_box = QDoubleSpinBox(minimum=0.0, maximum=60.0, singleStep=1.0, value=5.0)
        self.smooth_box.setSuffix(" s")
        self.smooth_box.setToolTip("the big genre label averages the focused model's probabilities "
                                   "exponentially over about this long (0: each 0.25 s step as is)")
        f.addRow("Genre smoothing", self.smooth_box)
        return mod

    def show_file(self, path: str) -> None:
        """The file's name, elided in the middle to the panel's width; the full path as tooltip."""
        name = Path(path).name
        self.file_label.setText(self.file_label.fontMetrics().elidedText(name, Qt.ElideMiddle, 260))
        self.file_label.setToolTip(path)

    def refresh_devices(self) -> None:
        from audio.sources import list_input_devices
        current = self.device_box.currentText()
        self.device_box.clear()
        try:
            devices = list_input_devices()
        except AudioError as e:
            devices = []
            self.device_box.setToolTip(str(e))
        for d in devices:
            self.device_box.addItem(d["name"], d["index"])
        if not devices:
            self.device_box.addItem("(no input devices found)", None)
        i = self.device_box.findText(current)
        if i >= 0:
            self.device_box.setCurrentIndex(i)
