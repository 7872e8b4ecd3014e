"""The main window: the genre (header and genre panel) in the middle, the controls, costs,
comparison table and spectrogram in dock panels around it (docks.py), a status bar. Everything
heavy runs in the engine worker (worker.py); this thread reads finished StepResults on a 33 ms
timer."""
from __future__ import annotations

import copy
import time
from collections import deque
from pathlib import Path

import torch
from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QFileDialog, QLabel, QMainWindow, QVBoxLayout, QWidget

from app.runtime.engine import Engine
from app.runtime.frontend_args import frontend_or_random
from app.runtime.lineup import Entry, ShippedLineup, load_trained
from app.runtime.sources import SourceKind, SourceSpec
from app.runtime.steplog import StepLog
from audio.errors import AudioError, with_hint
from audio.frontends import DEFAULT_FRONTEND
from audio.melspec import HOPS_PER_MINUTE
from models.checkpoint import CheckpointError
from models.transformer import ModelConfig, build_model

from . import docks, export, settings as store
from .controls import SidePanel
from .cost_panel import CostPanel
from .genre_panel import GenrePanel
from .ranking import RankingPanel
from .header import Header
from .settings import Options, share_the_gil
from .spectrogram import SpectrogramPanel
from .table import ComparisonTable, preferred_focus, status_texts
from .worker import EngineWorker, WorkerThread

RECENT = 2 * HOPS_PER_MINUTE  # StepResults drawn: two minutes of hops
FRAME_MS = 33                 # GUI redraw period (about 30 fps at most)

class MainWindow(QMainWindow):
    def __init__(self, options: Options | None = None, settings: QSettings | None = None):
        super().__init__()
        share_the_gil()
        self.options = options or Options()
        self.settings = settings or QSettings("Nystream", "Nystream")
        self.setWindowTitle("Nystream — continual Nyström transformers, live")
        self.history = StepLog()                      # for export: packed, bounded in bytes
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
        store.load_settings(self)
        docks.restore(self, self.settings)
        store.apply_options(self)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.redraw)
        self.timer.start(FRAME_MS)
        if self.options.autostart:
            QTimer.singleShot(0, self.start)

    # ------------------------------------------------------------------ layout
    def _build_ui(self) -> None:
        side = self.side = SidePanel()
        for name in ("source_kind", "device_box", "file_label", "loop_box", "compute_box",
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
        for box in self.variant_boxes.values():
            box.toggled.connect(lambda _checked: self.sync_models())
        side.apply_btn.clicked.connect(lambda: self.sync_models(rebuild=True))
        self.mode_group.idToggled.connect(lambda i, on: on and self.switch_landmarks())
        self.reset_btn.clicked.connect(lambda: self.engine is not None and self.engine.reset_model(None))
        side.checkpoint_btn.clicked.connect(self.open_checkpoint_dialog)
        self.smooth_box.valueChanged.connect(lambda v: setattr(self.header.smoother, "seconds", v))
        side.csv_btn.clicked.connect(lambda: self._ask_path("Export step records", "CSV (*.csv)", self.export_csv))
        side.png_btn.clicked.connect(lambda: self._ask_path("Export plots", "PNG (*.png)", self.export_png))

        centre = QWidget()
        col = QVBoxLayout(centre)
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
        path, _ = QFileDialog.getOpenFileName(self, "Load checkpoint", "", "Checkpoints (*.pt);;All files (*)")
        if path:
            self.load_checkpoint(path)

    def load_checkpoint(self, path: str) -> bool:
        """Add a trained model; it must have been trained on the chosen front end's tokens."""
        try:
            entry = load_trained(path, self.frontend_name, self.device)
        except CheckpointError as e:
            self.show_error(f"Cannot load checkpoint: {with_hint(e)}")
            return False
        entry.name = f"{entry.model.cfg.key} [{Path(path).stem}]"
        self.checkpoint_models[entry.name] = entry
        if self.engine is not None:
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
        """What the ticked variants run (app/lineup.py): shipped trained models, else untrained."""
        ticked = [v for v, box in self.variant_boxes.items() if box.isChecked()]
        return self.lineup.wanted(self.frontend_name, self.device, ticked, layers=self.layers_box.value(),
                                  window=self.window_box.value(), landmarks=self.landmarks_box.value())

    def build_untrained(self, cfg: ModelConfig):
        return build_model(cfg, seed=0).to(self.device)    # the same untrained weights every run

    def _add(self, name: str, what) -> None:
        spacing = self.frontend.native_spacing if self.frontend is not None else 1
        if isinstance(what, Entry):        # a copy: live landmark fits never touch the shipped model
            self.engine.add_model(name, copy.deepcopy(what.model).to(self.device), trained=True,
                                  spacing=what.spacing, frontend=what.frontend, classes=what.classes)
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
        """The chosen front end; missing VGGish weights: said in the window, random ones used."""
        def warn(e):
            self.show_error(f"{e}\nRunning with RANDOM VGGish weights: predictions are not "
                            f"meaningful. {e.hint}")
        o = self.options
        return frontend_or_random(self.frontend_name, device=self.device, vggish_weights=o.vggish_weights,
                                  random_vggish=o.random_vggish, on_missing=warn)

    def source_spec(self) -> SourceSpec:
        """The chosen source, read from the widgets (GUI thread); the worker opens it."""
        kind = SourceKind(self.source_kind.currentData())
        if kind is SourceKind.FILE:
            return SourceSpec(kind, self.file_path or "", loop=self.loop_box.isChecked())
        if kind is SourceKind.MIC:
            device = self.device_box.currentData()
            if device is None and self.device_box.isEditable():
                device = self.device_box.currentText()
            return SourceSpec(kind, "" if device is None else str(device))
        return SourceSpec(SourceKind.DEMO)

    def start(self) -> None:
        self.stop()
        try:
            fe = self.frontend
            if fe is None or fe.name != self.frontend_name or fe.device != torch.device(self.device):
                self.frontend = self._frontend()
        except AudioError as e:
            self.show_error(with_hint(e))
            return
        fe = self.frontend
        self.spectrogram.set_spectrogram(fe.bands, fe.mel_levels, fe.frame_ms)
        self.genre.reset()
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
            self._add(name, e)
        if self.mode_fixed.isChecked():
            self.switch_landmarks()
        self.history.clear()
        self.recent.clear()
        worker = EngineWorker(self.engine, self.source_spec().open)
        worker.error.connect(self.on_worker_error)
        worker.finished.connect(self.on_finished)         # queued: runs in this (GUI) thread
        self.runner = WorkerThread(worker)
        self.runner.start()
        self.paused = self.failed = False                 # failed: an error ended this run
        self.pause_btn.setText("Pause")
        self.pause_btn.setEnabled(True)
        self.statusBar().clearMessage()
        self.header.start_run()
        self.save_settings()

    def toggle_pause(self) -> None:
        if self.runner is None or not self.pause_btn.isEnabled():     # none running, or it ended
            return
        self.paused = not self.paused
        self.runner.worker.set_paused(self.paused)
        self.pause_btn.setText("Resume" if self.paused else "Pause")

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop(1.0)
            self.runner = None

    def on_finished(self) -> None:
        """A run ended: its source ran out (a file without loop) or Stop / a new start ended it."""
        if self.runner is not None and self.sender() is not self.runner.worker:
            return                                        # an earlier run, already replaced
        self.redraw()                                     # its last results first
        self.pause_btn.setEnabled(False)
        how = ("stopped" if self.runner is None else "ended by an error: see the message above"
               if self.failed else "finished: the source ended")
        self.statusBar().showMessage(self.header.end_run(how, self.history, self.focus_box.currentText()))

    def on_worker_error(self, error: BaseException) -> None:
        """The run ended with ``error``: its message and the hint its type carries."""
        self.failed = True
        self.show_error(with_hint(error) if isinstance(error, AudioError)
                        else f"processing stopped: {type(error).__name__}: {error}")

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
            self.header.push(r)
            self.genre.push(r, self.header.smoother.state)
            if r.mel is not None:
                self.spectrogram.push_mel(r.mel)
                r.mel = None                # the spectrogram keeps its own last 10 s
        events = [e for r in new for e in r.events]    # control feedback: the last of each kind
        errors = [e for e in events if e.startswith("error")]
        if errors:
            self.show_error(errors[-1] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        if len(errors) < len(events):
            self.statusBar().showMessage([e for e in events if not e.startswith("error")][-1], 15000)
        last = new[-1]
        models = list(last.models)
        self._update_focus(last, models)
        focus = self.focus_box.currentText()
        recent = list(self.recent)
        self.genre.redraw(recent, focus)
        self.cost.redraw(recent, models)
        self.ranking.redraw(recent, models, self.cost.flops_kind)
        self.spectrogram.redraw()
        if focus in last.models:
            self.header.show_focus(last, focus)
        elif not models:
            self.header.show_no_model()
        minute = recent[-HOPS_PER_MINUTE:]
        self.table.show_steps(minute)
        for key, text in status_texts(minute, self.paused, self.device, self.delay_ms).items():
            self.status[key].setText(text)
        now = time.monotonic()
        for r in new:
            if r.ready_time:
                self.delay_ms.append((now - r.ready_time) * 1e3)
        self.frame_ms.append((time.perf_counter() - t0) * 1e3)

    def _update_focus(self, last, models: list[str]) -> None:
        """Keep the focus list equal to the running models; prefer a trained continual Nyström."""
        focus = self.focus_box.currentText()
        if [self.focus_box.itemText(i) for i in range(self.focus_box.count())] == models:
            return
        self.focus_box.blockSignals(True)
        self.focus_box.clear()
        self.focus_box.addItems(models)
        chosen = preferred_focus(last.models, focus)
        if chosen is not None:
            self.focus_box.setCurrentText(chosen)
        self.focus_box.blockSignals(False)

    # ------------------------------------------------------------------ export
    export_csv = export.export_csv      # (self, path) -> rows written; said in the status bar
    export_png = export.export_png      # (self, path) -> saved?; the plot panels, captioned

    def screenshot(self, path: str) -> bool:
        return self.grab().save(path)
