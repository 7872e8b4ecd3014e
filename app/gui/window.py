"""The main window: the genre (header and genre panel) in the middle, the controls, costs,
comparison table and spectrogram in dock panels around it (docks.py), a status bar. Everything
heavy runs in the engine process (app/runtime/engine_process.py): this process only draws. A
timer reads what arrived every FRAME_MS; a frame with new hops redraws the plots, the ranking,
table and status bar follow once a second."""
from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QFileDialog, QLabel, QMainWindow, QVBoxLayout, QWidget

from app.runtime.engine_process import ENGINE_THREADS, EngineProcess, FrontEndFacts
from app.runtime.frontend_args import FrontEndSpec
from app.runtime.lineup import Entry, ModelSpec, ShippedLineup, load_onnx, load_trained
from app.runtime.onnx_step import OnnxModelError
from app.runtime.sources import SourceKind, SourceSpec
from app.runtime.steplog import StepLog
from audio.errors import with_hint
from audio.frontends import DEFAULT_FRONTEND
from audio.melspec import HOPS_PER_MINUTE
from app.checkpoint import CheckpointError
from models.transformer import ModelConfig

from . import docks, export, frames, settings as store
from .frames import PANELS
from .controls import SidePanel
from .cost_panel import CostPanel
from .genre_panel import GenrePanel
from .ranking import RankingPanel
from .header import Header
from .ini import IniSettings
from .settings import Options, SettingsNotice, default_settings_path
from .spectrogram import SpectrogramPanel
from .table import ComparisonTable

RECENT = 2 * HOPS_PER_MINUTE  # StepResults drawn: two minutes of hops
FRAME_MS = 50                 # GUI redraw period (20 frames a second at most)
SLOW_PANELS_S = 1.0           # the ranking, the table and the status bar: once a second


class MainWindow(QMainWindow):
    def __init__(self, options: Options | None = None, settings: IniSettings | None = None):
        super().__init__()
        torch.set_num_threads(1)                      # this process draws; the engine's has the cores
        self.options = options or Options()
        self.settings = settings or IniSettings(default_settings_path())
        self.setWindowTitle("Nystream — continual Nyström transformers, live")
        self.history = StepLog()                      # for export: packed, bounded in bytes
        self.recent: deque = deque(maxlen=RECENT)     # what the plots and the table show
        self.frame_ms: deque = deque(maxlen=2000)     # GUI-thread time per redraw with new hops
        self.panel_ms = {k: deque(maxlen=2000) for k in PANELS}   # the same, per panel drawn
        self.frame_cpu_ms: deque = deque(maxlen=2000)  # GUI-thread CPU from such a frame to the next tick
        self._drew, self._cpu_at = False, 0.0
        self.slow_panels_s = SLOW_PANELS_S            # the ranking, table and status bar's period
        self._slow_at = 0.0                           # when they were last drawn
        self.delay_ms: deque = deque(maxlen=2000)     # hop's last sample -> result drawn
        self.engine: EngineProcess | None = None      # kept between runs; a new one if it died
        self.running = False                          # a run is in progress (or starting)
        self.stopped = False                          # the user ended the run in progress
        self.failed = False                           # an error ended the run in progress
        self.facts: FrontEndFacts | None = None       # the engine's front end, once it said
        self.file_path: str | None = None
        self.checkpoint_models: dict[str, Entry] = {}   # name -> user-loaded trained model
        self.lineup = ShippedLineup(on_error=self.show_error)
        self.paused = False
        self.auto_names: set[str] = set()            # ticked-variant models this window runs
        self._build_ui()
        self.settings_problems = store.load_settings(self)   # bad values: replaced by defaults
        docks.restore(self, *self.saved_layout)
        store.apply_options(self)
        self.notice.show_problems(self.settings_problems)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.redraw)
        self.timer.start(FRAME_MS)
        self.prepared_s: float | None = None          # when the engine process was ready (s after it began)
        self.kernels: str | None = None               # how the models' steady steps run (engine's words)
        self.open_engine()
        if self.options.autostart:
            QTimer.singleShot(0, self.start)

    # ------------------------------------------------------------------ layout
    def _build_ui(self) -> None:
        side = self.side = SidePanel()
        for name in ("source_kind", "device_box", "file_label", "loop_box", "speed_box", "compute_box",
                     "frontend_box", "start_btn", "pause_btn", "stop_btn", "variant_boxes",
                     "layers_box", "window_box", "landmarks_box", "mode_group", "mode_continual",
                     "mode_fixed", "reset_btn", "focus_box", "smooth_box"):
            setattr(self, name, getattr(side, name))
        side.rescan_btn.clicked.connect(side.refresh_devices)
        side.open_btn.clicked.connect(self.open_file_dialog)
        self.frontend_box.activated.connect(lambda _: self.start())
        self.start_btn.clicked.connect(self.start)
        self.pause_btn.clicked.connect(self.toggle_pause)
        self.stop_btn.clicked.connect(self.stop)
        self.speed_box.currentIndexChanged.connect(lambda _: self.running and self.engine.set_speed(self.speed))
        for box in self.variant_boxes.values():
            box.toggled.connect(lambda _checked: self.sync_models())
        side.apply_btn.clicked.connect(lambda: self.sync_models(rebuild=True))
        self.mode_group.idToggled.connect(lambda i, on: on and self.switch_landmarks())
        self.reset_btn.clicked.connect(lambda: self.running and self.engine.reset_model(None))
        side.checkpoint_btn.clicked.connect(self.open_checkpoint_dialog)
        self.smooth_box.valueChanged.connect(lambda v: setattr(self.header.smoother, "seconds", v))
        side.csv_btn.clicked.connect(lambda: self._ask_path("Export step records", "CSV (*.csv)", self.export_csv))
        side.png_btn.clicked.connect(lambda: self._ask_path("Export plots", "PNG (*.png)", self.export_png))

        centre = QWidget()
        col = QVBoxLayout(centre)
        self.notice = SettingsNotice()              # what the settings file got wrong, until dismissed
        col.addWidget(self.notice)
        self.header = Header()
        self.banner, self.top_label, self.focus_label = (self.header.banner, self.header.top_label,
                                                         self.header.focus_label)
        col.addWidget(self.header)
        self.genre = GenrePanel()
        col.addWidget(self.genre, 1)
        self.setCentralWidget(centre)
        self.cost, self.table, self.spectrogram = CostPanel(), ComparisonTable(), SpectrogramPanel()
        self.ranking = RankingPanel()
        self.docks = {title: docks.dock(self, title, widget, area) for title, widget, area in (
            ("Controls", docks.scrolling(side), Qt.LeftDockWidgetArea),
            ("Costs", self.cost, Qt.RightDockWidgetArea),
            ("Comparison table", self.table, Qt.BottomDockWidgetArea),
            ("Ranking", self.ranking, Qt.BottomDockWidgetArea),
            ("Spectrogram", self.spectrogram, Qt.BottomDockWidgetArea))}
        self.splitDockWidget(self.docks["Comparison table"], self.docks["Ranking"], Qt.Horizontal)
        self.tabifyDockWidget(self.docks["Comparison table"], self.docks["Spectrogram"])
        self.docks["Comparison table"].raise_()
        self.resizeDocks([self.docks["Costs"], self.docks["Ranking"]], [560, 520], Qt.Horizontal)
        self.resizeDocks([self.docks["Comparison table"]], [230], Qt.Vertical)
        self.default_state = self.saveState()
        view = self.menuBar().addMenu("&View")
        for d in self.docks.values():
            view.addAction(d.toggleViewAction())
        view.addAction(QAction("Reset layout", self, triggered=lambda: self.restoreState(self.default_state)))
        self.status = {k: QLabel() for k in ("source", "run", "tokens")}
        for w in self.status.values():
            self.statusBar().addPermanentWidget(w)
        for text, key, slot in (("Quit", "Ctrl+Q", self.close), ("Pause / resume", "Ctrl+P", self.toggle_pause)):
            self.addAction(QAction(text, self, shortcut=key, triggered=slot))
        self.setAcceptDrops(True)
        self.side.refresh_devices()
        for label in self.findChildren(QLabel):        # names from files (classes, models, paths)
            if label is not self.header.verdict:       # never render as HTML
                label.setTextFormat(Qt.PlainText)

    def save_settings(self) -> None:
        store.save_settings(self)
        docks.save(self, self.settings)

    def set_source_kind(self, kind: SourceKind) -> None:
        self.source_kind.setCurrentIndex(max(self.source_kind.findData(kind.value), 0))

    # ------------------------------------------------------------------ messages
    def show_error(self, message: str) -> None:
        """A message in the window (click to dismiss); the app stays usable."""
        self.header.show_error(message)

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
            self.set_source_kind(SourceKind.FILE)

    def set_file(self, path: str) -> None:
        self.file_path = path
        self.side.show_file(path)

    def dragEnterEvent(self, event) -> None:  # noqa: N802 - Qt API
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:  # noqa: N802 - Qt API
        urls = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        if urls:
            self.set_file(urls[0])
            self.set_source_kind(SourceKind.FILE)
            self.start()

    def open_checkpoint_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load checkpoint", "",
                                              "Checkpoints and ONNX exports (*.pt *.onnx);;All files (*)")
        if path:
            self.load_checkpoint(path)

    def load_checkpoint(self, path: str) -> bool:
        """Add a trained model (a checkpoint, or an exported step: `main.py export`, run by ONNX
        Runtime); it must have been trained on the chosen front end's tokens."""
        try:
            if path.endswith(".onnx"):
                entry = load_onnx(path, self.frontend_name)              # named onnx:<key>
            else:
                entry = load_trained(path, self.frontend_name, self.device)
                entry.name = entry.model.cfg.key
        except (CheckpointError, OnnxModelError) as e:
            self.show_error(f"Cannot load checkpoint: {with_hint(e)}")
            return False
        entry.name = f"{entry.name} [{Path(path).stem}]"
        self.checkpoint_models[entry.name] = entry
        if self.running:
            self._add(entry.name, entry)
        return True

    # ------------------------------------------------------------------ models
    @property
    def device(self) -> str:
        return self.compute_box.currentData() or "cpu"

    @property
    def frontend_name(self) -> str:
        return self.frontend_box.currentData() or DEFAULT_FRONTEND

    def wanted_models(self) -> dict[str, Entry | ModelConfig]:
        """What the ticked variants run (app/runtime/lineup.py): shipped trained models, else untrained."""
        ticked = [v for v, box in self.variant_boxes.items() if box.isChecked()]
        return self.lineup.wanted(self.frontend_name, self.device, ticked, layers=self.layers_box.value(),
                                  window=self.window_box.value(), landmarks=self.landmarks_box.value())

    def _model(self, name: str, what) -> tuple[str, ModelSpec, dict]:
        """(name, spec, add_model keywords) of ``what``: a trained Entry, or an untrained config at
        the front end's native spacing, seed 0 (the same weights every run)."""
        if isinstance(what, Entry):
            return name, what.spec(self.device), dict(trained=True, spacing=what.spacing,
                                                      frontend=what.frontend, classes=what.classes)
        return name, ModelSpec(config=what, seed=0, device=self.device), dict(spacing=None)

    def _add(self, name: str, what) -> None:
        """Run ``what`` from the next hop; the engine process builds it."""
        name, spec, kwargs = self._model(name, what)
        self.engine.add_model(name, spec, **kwargs)

    def sync_models(self, rebuild: bool = False) -> None:
        """Make the running models match the checkboxes (and untrained shapes, if ``rebuild``)."""
        if not self.running:
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
        if self.running:
            self.engine.use_fixed_landmarks(self.mode_fixed.isChecked())

    # ------------------------------------------------------------------ run control
    def frontend_spec(self) -> FrontEndSpec:
        """The chosen front end, built by the engine process (missing VGGish weights: it says
        so, and runs random ones)."""
        o = self.options
        return FrontEndSpec(self.frontend_name, vggish_weights=o.vggish_weights,
                            random_vggish=o.random_vggish, device=self.device, allow_download=True)

    def source_spec(self) -> SourceSpec:
        """The chosen source, read from the widgets; the engine process opens it."""
        kind = SourceKind(self.source_kind.currentData())
        if kind is SourceKind.FILE:
            return SourceSpec(kind, self.file_path or "", loop=self.loop_box.isChecked(), speed=self.speed)
        if kind is SourceKind.MIC:
            device = self.device_box.currentData()
            if device is None and self.device_box.isEditable():
                device = self.device_box.currentText()
            return SourceSpec(kind, "" if device is None else str(device))
        return SourceSpec(SourceKind.DEMO, speed=self.speed)

    @property
    def speed(self) -> float:
        """The chosen playback speed of a file or the demo."""
        return self.speed_box.currentData()

    def open_engine(self) -> None:
        """A fresh engine process, preparing the chosen front end and the compiled forms while
        the user chooses (Start then finds them ready)."""
        self.engine = EngineProcess(torch_threads=ENGINE_THREADS)
        self.engine.prepare(self.frontend_spec())

    def start(self) -> None:
        """A new run on the chosen source, front end and models (a fresh engine process if
        the last one died)."""
        self.stop()
        if self.engine is None or not self.engine.alive():
            self.open_engine()
        self.genre.reset()
        self.history.clear()
        self.recent.clear()
        wanted = self.wanted_models()
        models = [self._model(name, what) for name, what in wanted.items()]
        fe = self.frontend_name
        for name, e in self.checkpoint_models.items():
            if e.frontend != fe:
                self.show_error(f"{name} was trained on {e.frontend} tokens and does not run on the "
                                f"{fe} front end; choose {e.frontend} under Front end to run it.")
                continue
            models.append(self._model(name, e))
        self.engine.start_run(self.frontend_spec(), self.source_spec(), models)   # in from the first hop
        self.running, self.stopped, self.failed = True, False, False
        self.auto_names = set(wanted)
        if self.mode_fixed.isChecked():
            self.switch_landmarks()
        self.paused = False
        self.pause_btn.setText("Pause")
        self.pause_btn.setEnabled(True)
        self.statusBar().clearMessage()
        self.header.start_run()
        self.save_settings()

    def toggle_pause(self) -> None:
        if not self.running or not self.pause_btn.isEnabled():     # none running, or it ended
            return
        self.paused = not self.paused
        self.engine.set_paused(self.paused)
        self.pause_btn.setText("Resume" if self.paused else "Pause")

    def stop(self) -> None:
        """End the run in progress (the engine process stays, for the next)."""
        if self.running:
            self.stopped = True
            self.engine.stop()

    def on_finished(self) -> None:
        """A run ended: its source ran out (a file without loop), Stop ended it, or an error."""
        self.running = False
        self.pause_btn.setEnabled(False)
        how = ("ended by an error: see the message above" if self.failed else "stopped"
               if self.stopped else "finished: the source ended")
        self.statusBar().showMessage(self.header.end_run(how, self.history, self.focus_box.currentText()))

    def on_engine_error(self, message: str) -> None:
        """The run ended with an error: its message (with the hint its type carries)."""
        self.failed = True
        self.show_error(message)

    def on_engine_died(self, cause: str) -> None:
        """The engine process is gone: said in one line; what was drawn and recorded stays, and
        Start begins a fresh engine."""
        if self.running:
            self.failed = True
            self.show_error(f"{cause}; the run ended. What was drawn is kept (export it from "
                            f"Controls); Start runs a fresh engine.")
            self.on_finished()
        self.engine.close(timeout=0.5)          # reaped, its pipe closed
        self.engine = None

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt API
        self.timer.stop()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.running = False
        self.save_settings()
        super().closeEvent(event)

    # ------------------------------------------------------------------ drawing (GUI thread)
    def drain(self) -> list:
        """The hops that arrived since the last frame; the engine's other news is acted on."""
        if self.engine is None:
            return []
        new, ended, died = [], False, None
        for kind, *rest in self.engine.poll():
            if kind == "step":
                new.append(rest[0])
            elif kind == "prepared":
                self.prepared_s = rest[0]
            elif kind == "ready":
                self.facts = f = rest[0]
                self.spectrogram.set_spectrogram(f.bands, f.mel_levels, f.frame_ms)
                self.cost.set_push(None)
            elif kind == "push":
                self.cost.set_push(rest[0])
                if rest[0] is not None and rest[0].startswith("eager: "):
                    self.statusBar().showMessage(f"The musicnn push runs {rest[0]}", 15000)
            elif kind == "kernels":
                self.kernels = rest[0]
                if rest[0] is not None and rest[0].startswith("eager: "):
                    self.statusBar().showMessage(f"The models' steady steps run {rest[0]}", 15000)
            elif kind == "warn":
                self.show_error(rest[0])
            elif kind == "error":
                self.on_engine_error(rest[0])
            elif kind == "finished":
                ended = True
            elif kind == "died":
                died = rest[0]
        if ended or died:                 # its last hops first, every panel, then the end
            self._slow_at = 0.0
            self._draw(new)
            new = []
            if died:
                self.on_engine_died(died)
            elif self.running:
                self.on_finished()
        return new

    redraw = frames.redraw           # the timer's tick (frames.py)
    _draw = frames.draw

    # ------------------------------------------------------------------ export
    export_csv = export.export_csv      # (self, path) -> rows written; said in the status bar
    export_png = export.export_png      # (self, path) -> saved?; the plot panels, captioned

    def screenshot(self, path: str) -> bool:
        return self.grab().save(path)
