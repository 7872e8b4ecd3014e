"""The main window: source and model controls, live plots, comparison table, status bar.

Everything heavy runs in the engine worker (app/gui/worker.py); this thread only reads finished
StepResults on a 33 ms timer (about 30 fps at most) and redraws. Settings persist with QSettings.
"""
from __future__ import annotations

import copy
import csv
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtGui import QAction, QFont
from PySide6.QtWidgets import (QButtonGroup, QCheckBox, QComboBox, QFileDialog, QFormLayout,
                               QGroupBox, QHBoxLayout, QHeaderView, QLabel, QMainWindow,
                               QPushButton, QRadioButton, QSpinBox, QSplitter, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from app.engine import Engine
from app.lineup import Entry, ShippedLineup, load_trained, model_name
from audio.errors import AudioError, VGGishWeightsError
from audio.frontends import DEFAULT_FRONTEND, FRONTENDS
from models.checkpoint import CheckpointError
from models.evaluation import percentile
from models.sda import VARIANTS
from models.transformer import ModelConfig, build_model

from .plots import LivePlots
from .worker import EngineWorker, WorkerThread

HISTORY = 14400               # StepResults kept for export (one hour of hops)
RECENT = 480                  # StepResults drawn: two minutes of hops
FRAME_MS = 33                 # GUI redraw period (about 30 fps at most)
GIL_SWITCH_S = 1e-4           # see share_the_gil()


def share_the_gil() -> None:
    """Let the engine's worker thread get the GIL back sooner while the GUI thread draws. Each
    of the worker's ~150 small torch calls per hop (continual front end) releases the GIL and
    must wait to take it back; at Python's default 5 ms switch interval a hop of the musicnn
    front end took ~220 ms in the window instead of ~14 ms alone, at 0.1 ms ~150 ms
    (measured on a 2-core machine, README "Benchmark")."""
    sys.setswitchinterval(GIL_SWITCH_S)


@dataclass
class Options:
    """What the window starts with (command line > saved settings > defaults)."""
    source: str | None = None                 # 'demo' | 'mic' | 'mic:DEVICE' | 'file:PATH'
    variants: list[str] | None = None
    checkpoints: list[str] = field(default_factory=list)
    frontend: str | None = None               # 'musicnn' | 'vggish' (default: saved, else musicnn)
    vggish_weights: str | None = None
    random_vggish: int | None = None
    autostart: bool = True


class MainWindow(QMainWindow):
    def __init__(self, options: Options | None = None, settings: QSettings | None = None):
        super().__init__()
        share_the_gil()
        self.options = options or Options()
        self.settings = settings or QSettings("Nystream", "Nystream")
        self.setWindowTitle("Nystream — continual Nyström transformers, live")
        self.resize(1500, 950)
        self.history: deque = deque(maxlen=HISTORY)   # for export
        self.recent: deque = deque(maxlen=RECENT)     # what the plots and the table show
        self.frame_ms: deque = deque(maxlen=2000)     # GUI-thread time per redraw
        self.delay_ms: deque = deque(maxlen=2000)     # hop's last sample -> result drawn
        self.runner: WorkerThread | None = None
        self.engine: Engine | None = None
        self.frontend = None                          # the built FrontEnd (rebuilt on change)
        self.file_path: str | None = None
        self.checkpoint_models: dict[str, Entry] = {}   # name -> user-loaded trained model
        self.lineup = ShippedLineup(on_error=self.show_error)
        self.paused = False
        self.auto_names: set[str] = set()            # ticked-variant models this window runs
        self._build_ui()
        self._load_settings()
        self._apply_options()
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.redraw)
        self.timer.start(FRAME_MS)
        if self.options.autostart:
            QTimer.singleShot(0, self.start)

    # ------------------------------------------------------------------ layout
    def _build_ui(self) -> None:
        side = QWidget()
        side.setFixedWidth(310)
        col = QVBoxLayout(side)

        src = QGroupBox("Source")
        f = QFormLayout(src)
        self.source_kind = QComboBox()
        self.source_kind.addItems(["Demo signal", "Microphone", "File"])
        f.addRow("Input", self.source_kind)
        self.device_box = QComboBox()
        self.device_box.setToolTip("input devices PortAudio reports on this machine")
        f.addRow("Device", self.device_box)
        rescan = QPushButton("Rescan devices")
        rescan.clicked.connect(self.refresh_devices)
        f.addRow("", rescan)
        self.file_label = QLabel("no file (open one, or drop it on the window)")
        self.file_label.setWordWrap(True)
        open_btn = QPushButton("Open file…")
        open_btn.clicked.connect(self.open_file_dialog)
        f.addRow(open_btn, self.file_label)
        self.loop_box = QCheckBox("Loop file (real-time pace)")
        f.addRow("", self.loop_box)
        self.compute_box = QComboBox()
        self.compute_box.addItem("CPU", "cpu")
        if torch.cuda.is_available():
            self.compute_box.addItem(f"CUDA ({torch.cuda.get_device_name(0)})", "cuda")
        f.addRow("Compute", self.compute_box)
        self.frontend_box = QComboBox()
        for name in FRONTENDS:
            self.frontend_box.addItem({"musicnn": "musicnn (pretrained, ships)",
                                       "vggish": "VGGish (the paper's)"}[name], name)
        self.frontend_box.setToolTip("token front end; models run only on the tokens they were trained on")
        self.frontend_box.activated.connect(lambda _: self.start())
        f.addRow("Front end", self.frontend_box)
        buttons = QHBoxLayout()
        self.start_btn, self.pause_btn, self.stop_btn = (QPushButton(t) for t in ("Start", "Pause", "Stop"))
        self.start_btn.clicked.connect(self.start)
        self.pause_btn.clicked.connect(self.toggle_pause)
        self.stop_btn.clicked.connect(self.stop)
        for b in (self.start_btn, self.pause_btn, self.stop_btn):
            buttons.addWidget(b)
        f.addRow(buttons)
        col.addWidget(src)

        mod = QGroupBox("Models (side by side)")
        f = QFormLayout(mod)
        self.variant_boxes = {}
        for v in VARIANTS:
            box = QCheckBox(v)
            box.setToolTip("trained (shipped) model when one exists for the front end, else untrained")
            box.toggled.connect(lambda _checked: self.sync_models())
            self.variant_boxes[v] = box
            f.addRow(box)
        self.layers_box = QSpinBox(minimum=1, maximum=2, value=1)
        self.window_box = QSpinBox(minimum=4, maximum=1920, value=120)
        self.window_box.setSuffix(" tokens")
        self.landmarks_box = QSpinBox(minimum=1, maximum=64, value=4)
        f.addRow("Blocks", self.layers_box)
        f.addRow("Window n", self.window_box)
        f.addRow("Landmarks m", self.landmarks_box)
        rebuild = QPushButton("Apply shape (untrained models only)")
        rebuild.clicked.connect(lambda: self.sync_models(rebuild=True))
        f.addRow(rebuild)
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
        self.mode_group.idToggled.connect(lambda i, on: on and self.switch_landmarks())
        f.addRow("Landmarks (live)", lm)
        self.reset_btn = QPushButton("Reset model states (empty windows)")
        self.reset_btn.clicked.connect(lambda: self.engine is not None and self.engine.reset_model(None))
        f.addRow(self.reset_btn)
        ck = QPushButton("Load checkpoint…")
        ck.clicked.connect(self.open_checkpoint_dialog)
        f.addRow(ck)
        self.focus_box = QComboBox()
        f.addRow("Focus", self.focus_box)
        self.flops_kind = QComboBox()
        self.flops_kind.addItem("SDA", "sda")
        self.flops_kind.addItem("attention (with projections)", "attention")
        self.flops_kind.addItem("whole model", "model")
        self.flops_kind.currentIndexChanged.connect(
            lambda: setattr(self.plots, "flops_kind", self.flops_kind.currentData()))
        f.addRow("FLOPs plot", self.flops_kind)
        col.addWidget(mod)

        exp = QGroupBox("Export")
        h = QHBoxLayout(exp)
        csv_btn, png_btn = QPushButton("Steps → CSV…"), QPushButton("Plots → PNG…")
        csv_btn.clicked.connect(lambda: self._ask_path("Export step records", "CSV (*.csv)", self.export_csv))
        png_btn.clicked.connect(lambda: self._ask_path("Export plots", "PNG (*.png)", self.export_png))
        h.addWidget(csv_btn)
        h.addWidget(png_btn)
        col.addWidget(exp)
        col.addStretch(1)

        main = QWidget()
        mcol = QVBoxLayout(main)
        self.banner = QLabel()
        self.banner.setWordWrap(True)
        self.banner.setStyleSheet("background:#fde2e1;color:#7a1712;padding:6px;border:1px solid #e0a09c;")
        self.banner.hide()
        self.banner.mousePressEvent = lambda e: self.banner.hide()
        mcol.addWidget(self.banner)
        top = QHBoxLayout()
        self.top_label = QLabel("—")
        big = QFont()
        big.setPointSize(26)
        big.setBold(True)
        self.top_label.setFont(big)
        self.focus_label = QLabel("")
        top.addWidget(self.top_label)
        top.addStretch(1)
        top.addWidget(self.focus_label)
        mcol.addLayout(top)
        split = QSplitter(Qt.Vertical)
        self.plots = LivePlots()
        split.addWidget(self.plots)
        self.table = QTableWidget(0, 9)
        self.table.setHorizontalHeaderLabels(
            ["model", "landmarks", "top genre", "agrees with regular", "SDA FLOPs/step",
             "model FLOPs/step", "latency median / p95 (ms)", "state memory", "weights"])
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.table.verticalHeader().hide()
        split.addWidget(self.table)
        split.setSizes([720, 180])
        mcol.addWidget(split)

        root = QWidget()
        h = QHBoxLayout(root)
        h.addWidget(side)
        h.addWidget(main, 1)
        self.setCentralWidget(root)

        self.status = {k: QLabel() for k in ("source", "frontend", "rtf", "dropped", "weights", "device", "delay")}
        for w in self.status.values():
            self.statusBar().addPermanentWidget(w)
        quit_action = QAction("Quit", self)
        quit_action.setShortcut("Ctrl+Q")
        quit_action.triggered.connect(self.close)
        self.addAction(quit_action)
        self.setAcceptDrops(True)
        self.refresh_devices()

    # ------------------------------------------------------------------ settings
    def _load_settings(self) -> None:
        s = self.settings
        self.source_kind.setCurrentIndex(int(s.value("source/kind", 0)))
        device = s.value("source/device", "")
        if device:
            i = self.device_box.findText(device)
            if i >= 0:
                self.device_box.setCurrentIndex(i)
        path = s.value("source/file", "")
        if path and Path(path).is_file():
            self.set_file(path)
        self.loop_box.setChecked(s.value("source/loop", "true") in ("true", True))
        saved = s.value("models/variants", None)
        chosen = list(VARIANTS) if saved is None else [v for v in str(saved).split(",") if v]
        for v, box in self.variant_boxes.items():
            box.blockSignals(True)
            box.setChecked(v in chosen)
            box.blockSignals(False)
        self.layers_box.setValue(int(s.value("models/layers", 1)))
        self.window_box.setValue(int(s.value("models/window", 120)))
        self.landmarks_box.setValue(int(s.value("models/landmarks", 4)))
        i = self.compute_box.findData(s.value("compute", "cuda" if torch.cuda.is_available() else "cpu"))
        self.compute_box.setCurrentIndex(max(i, 0))
        i = self.frontend_box.findData(s.value("frontend", DEFAULT_FRONTEND))
        self.frontend_box.setCurrentIndex(max(i, 0))

    def save_settings(self) -> None:
        s = self.settings
        s.setValue("source/kind", self.source_kind.currentIndex())
        s.setValue("source/device", self.device_box.currentText())
        s.setValue("source/file", self.file_path or "")
        s.setValue("source/loop", self.loop_box.isChecked())
        s.setValue("models/variants", ",".join(v for v, b in self.variant_boxes.items() if b.isChecked()))
        s.setValue("models/layers", self.layers_box.value())
        s.setValue("models/window", self.window_box.value())
        s.setValue("models/landmarks", self.landmarks_box.value())
        s.setValue("compute", self.compute_box.currentData())
        s.setValue("frontend", self.frontend_name)
        s.sync()

    def _apply_options(self) -> None:
        o = self.options
        frontend = o.frontend or ("vggish" if o.vggish_weights or o.random_vggish is not None else None)
        if frontend:
            self.frontend_box.setCurrentIndex(max(self.frontend_box.findData(frontend), 0))
        if o.source:
            kind, _, arg = o.source.partition(":")
            if kind == "demo":
                self.source_kind.setCurrentIndex(0)
            elif kind == "mic":
                self.source_kind.setCurrentIndex(1)
                if arg:
                    self.device_box.setEditable(True)
                    self.device_box.setCurrentText(arg)
            elif kind == "file":
                self.source_kind.setCurrentIndex(2)
                self.set_file(arg)
        if o.variants is not None:
            for v, box in self.variant_boxes.items():
                box.blockSignals(True)
                box.setChecked(v in o.variants)
                box.blockSignals(False)
        for path in o.checkpoints:
            self.load_checkpoint(path)

    # ------------------------------------------------------------------ messages
    def show_error(self, message: str) -> None:
        """A message in the window (click to dismiss); the app stays usable."""
        self.banner.setText(message)
        self.banner.show()

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

    # ------------------------------------------------------------------ files and checkpoints
    def _ask_path(self, title, pattern, action) -> None:
        path, _ = QFileDialog.getSaveFileName(self, title, "", pattern)
        if path:
            action(path)

    def open_file_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open audio file", "",
                                              "Audio (*.wav *.flac *.ogg *.mp3 *.au *.aiff);;All files (*)")
        if path:
            self.set_file(path)
            self.source_kind.setCurrentIndex(2)

    def set_file(self, path: str) -> None:
        self.file_path = path
        self.file_label.setText(Path(path).name)

    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt API
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt API
        urls = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        if urls:
            self.set_file(urls[0])
            self.source_kind.setCurrentIndex(2)
            self.start()

    def open_checkpoint_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load checkpoint", "", "Checkpoints (*.pt);;All files (*)")
        if path:
            self.load_checkpoint(path)

    def load_checkpoint(self, path: str) -> bool:
        """Add a trained model; it must have been trained on the chosen front end's tokens."""
        try:
            entry = load_trained(path, self.frontend_name, self.device)
        except CheckpointError as e:
            self.show_error(f"Cannot load checkpoint: {e}.")
            return False
        entry.name = model_name(entry.model.cfg, " [" + Path(path).stem + "]")
        self.checkpoint_models[entry.name] = entry
        if self.engine is not None:
            self.engine.add_model(entry.name, copy.deepcopy(entry.model), trained=True,
                                  spacing=entry.spacing, frontend=entry.frontend)
        return True

    # ------------------------------------------------------------------ models
    @property
    def device(self) -> str:
        return self.compute_box.currentData() or "cpu"

    @property
    def frontend_name(self) -> str:
        return self.frontend_box.currentData() or DEFAULT_FRONTEND

    def wanted_models(self) -> dict[str, Entry | ModelConfig]:
        """What the ticked variants run (app/lineup.py): shipped trained models, else untrained."""
        ticked = [v for v, box in self.variant_boxes.items() if box.isChecked()]
        return self.lineup.wanted(self.frontend_name, self.device, ticked, layers=self.layers_box.value(),
                                  window=self.window_box.value(), landmarks=self.landmarks_box.value())

    def build_untrained(self, cfg: ModelConfig):
        torch.manual_seed(0)                         # the same untrained weights every run
        return build_model(cfg).to(self.device)

    def _add(self, name: str, what) -> None:
        spacing = self.frontend.native_spacing if self.frontend is not None else 1
        if isinstance(what, Entry):        # a copy: live landmark fits never touch the shipped model
            self.engine.add_model(name, copy.deepcopy(what.model), trained=True, spacing=what.spacing,
                                  frontend=what.frontend)
        else:
            self.engine.add_model(name, self.build_untrained(what), spacing=spacing)

    def sync_models(self, rebuild: bool = False) -> None:
        """Make the running models match the checkboxes (and untrained shapes, if ``rebuild``)."""
        if self.engine is None:
            return
        wanted = self.wanted_models()
        for name in list(self.auto_names):
            if name not in wanted or (rebuild and not isinstance(wanted[name], Entry)):
                self.engine.remove_model(name)
                self.auto_names.discard(name)
        for name, what in wanted.items():
            if name not in self.auto_names:
                self._add(name, what)
        self.auto_names = set(wanted)
        if self.mode_fixed.isChecked():
            self.switch_landmarks()

    def switch_landmarks(self) -> None:
        """Apply the landmark switch to every Nyström model, live (also to models just added)."""
        if self.engine is not None:
            self.engine.use_fixed_landmarks(self.mode_fixed.isChecked())

    # ------------------------------------------------------------------ run control
    def _frontend(self):
        from audio.frontends import build_frontend
        o, name = self.options, self.frontend_name
        if name == "vggish" and o.random_vggish is not None:
            return build_frontend("vggish", random_vggish=o.random_vggish, device=self.device)
        try:
            return build_frontend(name, vggish_weights=o.vggish_weights, device=self.device)
        except VGGishWeightsError as e:
            self.show_error(f"{e}\nRunning with RANDOM VGGish weights: predictions are not meaningful. "
                            f"Put vggish-10086976.pth in the torch hub cache or pass --vggish-weights FILE, "
                            f"or choose the musicnn front end, whose weights ship.")
            return build_frontend("vggish", random_vggish=0, device=self.device)

    def source_factory(self):
        """A function that opens the chosen source. The widgets are read here, in the GUI thread;
        the function runs in the worker (opening a device or decoding a file takes time)."""
        from audio.sources import DemoSource, FileSource, MicrophoneSource
        kind, path, loop = self.source_kind.currentIndex(), self.file_path, self.loop_box.isChecked()
        device = self.device_box.currentData()
        if device is None and self.device_box.isEditable():
            device = self.device_box.currentText()

        def make():
            if kind == 0:
                return DemoSource(realtime=True)
            if kind == 1:
                return MicrophoneSource(device).start()
            if not path:
                raise AudioError("no file chosen: open a file (or drop one on the window) first")
            return FileSource(path, realtime=True, loop=loop)
        return make

    def start(self) -> None:
        self.stop()
        try:
            fe = self.frontend
            if fe is None or fe.name != self.frontend_name or fe.device != torch.device(self.device):
                self.frontend = self._frontend()
        except AudioError as e:
            self.show_error(str(e))
            return
        fe = self.frontend
        self.plots.set_spectrogram(fe.bands, fe.mel_levels, fe.frame_ms)
        self.engine = Engine(fe)
        wanted = self.wanted_models()
        for name, what in wanted.items():
            self._add(name, what)
        self.auto_names = set(wanted)
        for name, e in self.checkpoint_models.items():
            if e.frontend != fe.name:
                self.show_error(f"{name} was trained on {e.frontend} tokens and does not run on the "
                                f"{fe.name} front end; choose {e.frontend} under Front end to run it.")
                continue
            self.engine.add_model(name, copy.deepcopy(e.model).to(self.device), trained=True,
                                  spacing=e.spacing, frontend=e.frontend)
        if self.mode_fixed.isChecked():
            self.switch_landmarks()
        self.history.clear()
        self.recent.clear()
        worker = EngineWorker(self.engine, self.source_factory())
        worker.error.connect(self.on_worker_error)
        self.runner = WorkerThread(worker)
        self.runner.start()
        self.paused = False
        self.pause_btn.setText("Pause")
        self.save_settings()

    def toggle_pause(self) -> None:
        if self.runner is None:
            return
        self.paused = not self.paused
        self.runner.worker.set_paused(self.paused)
        self.pause_btn.setText("Resume" if self.paused else "Pause")

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop(1.0)
            self.runner = None

    def on_worker_error(self, message: str) -> None:
        hint = ""
        low = message.lower()
        if "device" in low or "portaudio" in low:
            hint = " Choose another input device (Rescan devices), or the demo signal or a file, and press Start."
        elif "file" in low or "decode" in low:
            hint = " Choose another file and press Start."
        self.show_error(message + hint)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt API
        self.timer.stop()
        self.stop()
        self.save_settings()
        super().closeEvent(event)

    # ------------------------------------------------------------------ drawing (GUI thread)
    def drain(self) -> list:
        if self.runner is None:
            return []
        new, results = [], self.runner.worker.results
        while results:
            new.append(results.popleft())
        return new

    def redraw(self) -> None:
        t0 = time.perf_counter()
        new = self.drain()
        if not new:
            return
        for r in new:
            self.history.append(r)
            self.recent.append(r)
            if r.mel is not None:
                self.plots.push_mel(r.mel)
            for e in r.events:
                if e.startswith("error"):
                    self.show_error(e)
        last = new[-1]
        models = list(last.probabilities)
        focus = self.focus_box.currentText()
        if [self.focus_box.itemText(i) for i in range(self.focus_box.count())] != models:
            self.focus_box.blockSignals(True)
            self.focus_box.clear()
            self.focus_box.addItems(models)
            preferred = [m for m in models if m.startswith("continual_nystrom")]
            if focus in models:
                self.focus_box.setCurrentText(focus)
            elif preferred:          # the product's model, trained ones first
                trained = [m for m in preferred if not last.untrained[m]]
                self.focus_box.setCurrentText((trained or preferred)[0])
            self.focus_box.blockSignals(False)
        focus = self.focus_box.currentText()
        recent = list(self.recent)
        self.plots.update(recent, focus, models)
        if focus in last.top:
            genre, p = last.top[focus]
            warn = "  (untrained)" if last.untrained[focus] else ""
            self.top_label.setText(f"{genre}  {100 * p:.0f}%{warn}")
            self.focus_label.setText(f"focused: {focus}")
        self.update_table(recent[-240:], models)
        self.update_status(recent[-240:])
        now = time.monotonic()
        for r in new:
            if r.ready_time:
                self.delay_ms.append((now - r.ready_time) * 1e3)
        self.frame_ms.append((time.perf_counter() - t0) * 1e3)

    def update_table(self, recent: list, models: list[str]) -> None:
        """One row per model over ``recent`` (the last minute of StepResults)."""
        last = recent[-1]
        self.table.setRowCount(len(models) + 1)
        front = [r.latency_ms["frontend"] for r in recent]
        self._set_row(len(models), [f"front end: {last.frontend}", "—", "—", "—", "—",
                                    f"{last.frontend_flops:,} (per hop)",
                                    f"{statistics.median(front):.2f} / {percentile(front, 0.95):.2f}",
                                    "—", "pretrained" if "RANDOM" not in last.frontend else "RANDOM"])
        for row, name in enumerate(models):
            lat = [r.latency_ms[name] for r in recent if name in r.latency_ms]
            steps = [r for r in recent if name in r.top and "regular" in r.top]
            agree = (f"{100 * sum(r.top[name][0] == r.top['regular'][0] for r in steps) / len(steps):.0f}%"
                     if steps and name != "regular" else "—")
            cells = [name, last.landmark_mode[name] or "—",
                     f"{last.top[name][0]} {100 * last.top[name][1]:.0f}%", agree,
                     f"{last.flops[name]['sda']:,}", f"{last.flops[name]['model']:,}",
                     f"{statistics.median(lat):.2f} / {percentile(lat, 0.95):.2f}",
                     f"{last.state_bytes[name] / 1024:.1f} KiB",
                     "UNTRAINED (random)" if last.untrained[name] else "trained"]
            self._set_row(row, cells)

    def _set_row(self, row: int, cells: list[str]) -> None:
        for c, text in enumerate(cells):
            item = self.table.item(row, c)
            if item is None:
                item = QTableWidgetItem()
                self.table.setItem(row, c, item)
            item.setText(text)

    def update_status(self, recent: list) -> None:
        """The status bar from ``recent`` (the last minute of StepResults)."""
        last = recent[-1]
        rtf = statistics.fmean(r.latency_ms["frontend"] + sum(r.latency_ms[n] for n in r.top)
                               for r in recent) / 250.0
        front = [r.latency_ms["frontend"] for r in recent]
        self.status["frontend"].setText(f"Front end: {statistics.median(front):.1f} / "
                                        f"{percentile(front, 0.95):.1f} ms median / p95, "
                                        f"{last.frontend_flops / 1e6:.0f}M FLOPs/hop")
        source = self.runner.worker.source if self.runner else None
        rate = f", {source.input_rate} Hz in" if source is not None else ""
        self.status["source"].setText(f"Source: {last.source}{rate}{'  (paused)' if self.paused else ''}")
        self.status["rtf"].setText(f"Real-time factor: {rtf:.2f}")
        self.status["dropped"].setText(f"Dropped hops: {last.dropped_hops}")
        self.status["weights"].setText(f"Tokens: {last.frontend}")
        self.status["device"].setText(f"Compute: {self.device}")
        if self.delay_ms:
            self.status["delay"].setText(f"Delay p95: {percentile(self.delay_ms, 0.95):.0f} ms")

    # ------------------------------------------------------------------ export
    def export_csv(self, path: str) -> int:
        """Write every kept step record (one row per hop, all models); returns the row count."""
        from app.classify import csv_row
        rows = [csv_row(r) for r in self.history]
        fields: list[str] = []
        for row in rows:
            fields += [k for k in row if k not in fields]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
        return len(rows)

    def export_png(self, path: str) -> bool:
        return self.plots.grab().save(path)

    def screenshot(self, path: str) -> bool:
        return self.grab().save(path)
