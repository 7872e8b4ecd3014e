"""What the window starts with and remembers: command-line Options over the saved settings (app/gui/ini.py)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PySide6.QtCore import QByteArray, QStandardPaths, Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton

from app.runtime.sources import SourceKind, SourceSpec
from audio.frontends import DEFAULT_FRONTEND
from models.sda import VARIANTS


@dataclass
class Options:
    """What the window starts with (command line > saved settings > defaults)."""
    source: str | None = None                 # 'demo' | 'mic' | 'mic:DEVICE' | 'file:PATH'
    variants: list[str] | None = None
    checkpoints: list[str] = field(default_factory=list)
    frontend: str | None = None               # 'musicnn' | 'vggish' (default: saved, else musicnn)
    vggish_weights: str | None = None
    random_vggish: int | None = None
    speed: float | None = None                # a file's or the demo's playback speed (audio.sources.SPEEDS)
    autostart: bool = True


KNOWN_KEYS = frozenset((
    "source/kind", "source/device", "source/file", "source/loop", "source/speed", "models/variants", "models/layers",
    "models/window", "models/landmarks", "view/smoothing_s", "cost/flops_kind", "table/reference",
    "compute", "frontend", "window/geometry", "window/state"))


def default_settings_path() -> Path:
    """Where the window keeps its settings: the user's config folder (QSettings' own place)."""
    base = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.GenericConfigLocation)
    return Path(base or os.path.expanduser("~/.config")) / "Nystream" / "Nystream.conf"


class SettingsNotice(QFrame):
    """What the settings file got wrong, in full (plain text, wrapped), until the user dismisses it."""

    def __init__(self):
        super().__init__()
        self.setFrameShape(QFrame.StyledPanel)
        self.setStyleSheet("SettingsNotice { background: #fff4d6; }")
        row = QHBoxLayout(self)
        row.setContentsMargins(6, 3, 6, 3)
        self.label = QLabel()
        self.label.setTextFormat(Qt.PlainText)
        self.label.setWordWrap(True)
        self.dismiss = QPushButton("Dismiss")
        self.dismiss.clicked.connect(self.hide)
        row.addWidget(self.label, 1)
        row.addWidget(self.dismiss)
        self.hide()

    def show_problems(self, problems: list[str]) -> None:
        if problems:
            self.label.setText("Settings file: " + "; ".join(problems))
            self.show()

    def text(self) -> str:
        """The notice as shown; empty once dismissed (or when there was nothing to say)."""
        return "" if self.isHidden() else self.label.text()


class Reader:
    """The settings file's values, validated like command-line arguments: a value of the wrong
    type, out of range or unknown is replaced by its default and named in ``problems`` (the
    window says so in its status bar, and the next save writes the defaults back)."""

    def __init__(self, settings):
        self.s, self.problems = settings, []

    def _bad(self, key: str, raw, what: str, default) -> None:
        self.problems.append(f"{key}={str(raw)[:40]!r} is not {what} (using {default})")

    def number(self, key: str, default, lo, hi):
        raw = self.s.value(key, None)
        if raw is None:
            return default
        kind = type(default)
        try:
            value = kind(str(raw))
            if not lo <= value <= hi:          # also false for NaN
                raise ValueError
            return value
        except (TypeError, ValueError):
            self._bad(key, raw, f"{'an integer' if kind is int else 'a number'} from {lo} to {hi}", default)
            return default

    def choice(self, key: str, default: str, choices) -> str:
        raw = self.s.value(key, None)
        if raw is None:
            return default
        if str(raw) not in choices:
            self._bad(key, raw, "one of " + ", ".join(map(str, choices)), default)
            return default
        return str(raw)

    def flag(self, key: str, default: bool) -> bool:
        raw = self.s.value(key, None)
        if raw is None or isinstance(raw, bool):
            return default if raw is None else raw
        if str(raw).lower() in ("true", "false"):
            return str(raw).lower() == "true"
        self._bad(key, raw, "true or false", str(default).lower())
        return default

    def text(self, key: str, default: str = "") -> str:
        raw = self.s.value(key, None)
        if raw is None:
            return default
        if not isinstance(raw, str):                  # a list (an unquoted comma) or bytes
            self._bad(key, raw, "one text value (quote a value that holds a comma)", repr(default))
            return default
        return raw

    def blob(self, key: str):
        """Saved Qt state (bytes), or None."""
        raw = self.s.value(key, None)
        if raw is None or isinstance(raw, (QByteArray, bytes)):
            return raw
        self._bad(key, raw, "saved window state", "the default layout")
        return None


def load_settings(w) -> list[str]:
    """Restore the window's controls from its settings file; returns what was wrong in the file."""
    r = Reader(w.settings)
    r.problems.extend(getattr(w.settings, "problems", []))     # unreadable file, refused values
    unknown = sorted(set(w.settings.keys()) - KNOWN_KEYS)
    if unknown:
        r.problems.append(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (ignored)")
        for key in unknown:                                      # not written back
            w.settings.remove(key)
    w.set_source_kind(SourceKind(r.choice("source/kind", SourceKind.DEMO.value, [k.value for k in SourceKind])))
    device = r.text("source/device")
    if device and w.device_box.findText(device) >= 0:
        w.device_box.setCurrentIndex(w.device_box.findText(device))
    path = r.text("source/file")
    if path and Path(path).is_file():
        w.set_file(path)
    w.loop_box.setChecked(r.flag("source/loop", True))
    speeds = [f"{w.speed_box.itemData(i):g}" for i in range(w.speed_box.count())]
    w.speed_box.setCurrentIndex(speeds.index(r.choice("source/speed", "1", speeds)))
    saved = w.settings.value("models/variants", None)        # a hand-written a,b reads as a list
    items = saved if isinstance(saved, (list, tuple)) else str(saved).split(",")
    variants = list(VARIANTS) if saved is None else [str(v).strip() for v in items if str(v).strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        r.problems.append(f"models/variants: unknown {', '.join(unknown)} (left out)")
    tick(w, [v for v in variants if v in VARIANTS])
    for key, box, default in (("models/layers", w.layers_box, 1), ("models/window", w.window_box, 120),
                              ("models/landmarks", w.landmarks_box, 4), ("view/smoothing_s", w.smooth_box, 5.0)):
        box.setValue(r.number(key, default, box.minimum(), box.maximum()))
    w.cost.kind_box.setCurrentIndex(w.cost.kind_box.findData(
        r.choice("cost/flops_kind", "sda", [w.cost.kind_box.itemData(i) for i in range(w.cost.kind_box.count())])))
    w.table.wanted = r.text("table/reference")
    computes = [w.compute_box.itemData(i) for i in range(w.compute_box.count())]
    w.compute_box.setCurrentIndex(computes.index(r.choice("compute", computes[-1] if torch.cuda.is_available()
                                                          else computes[0], computes)))
    frontends = [w.frontend_box.itemData(i) for i in range(w.frontend_box.count())]
    w.frontend_box.setCurrentIndex(frontends.index(r.choice("frontend", DEFAULT_FRONTEND, frontends)))
    w.saved_layout = (r.blob("window/geometry"), r.blob("window/state"))
    return r.problems


def save_settings(w) -> None:
    s = w.settings
    s.setValue("source/kind", w.source_kind.currentData())
    s.setValue("source/device", w.device_box.currentText())
    s.setValue("source/file", w.file_path or "")
    s.setValue("source/loop", w.loop_box.isChecked())
    s.setValue("source/speed", f"{w.speed:g}")
    s.setValue("models/variants", ",".join(v for v, b in w.variant_boxes.items() if b.isChecked()))
    s.setValue("models/layers", w.layers_box.value())
    s.setValue("models/window", w.window_box.value())
    s.setValue("models/landmarks", w.landmarks_box.value())
    s.setValue("view/smoothing_s", w.smooth_box.value())
    w.cost.save(s)
    w.table.save(s)
    s.setValue("compute", w.compute_box.currentData())
    s.setValue("frontend", w.frontend_name)
    s.sync()


def apply_options(w) -> None:
    """Apply the command line's Options over the saved settings."""
    o = w.options
    frontend = o.frontend or ("vggish" if o.vggish_weights or o.random_vggish is not None else None)
    if frontend:
        w.frontend_box.setCurrentIndex(max(w.frontend_box.findData(frontend), 0))
    if o.source:
        spec = SourceSpec.parse(o.source)
        w.set_source_kind(spec.kind)
        if spec.kind is SourceKind.MIC and spec.arg:
            w.device_box.setEditable(True)
            w.device_box.setCurrentText(spec.arg)
        elif spec.kind is SourceKind.FILE:
            w.set_file(spec.arg)
    if o.speed is not None:
        w.speed_box.setCurrentIndex(w.speed_box.findData(o.speed))
    if o.variants is not None:
        tick(w, o.variants)
    for path in o.checkpoints:
        w.load_checkpoint(path)


def tick(w, variants) -> None:
    """Tick exactly ``variants`` without starting models (signals blocked)."""
    for v, box in w.variant_boxes.items():
        box.blockSignals(True)
        box.setChecked(v in variants)
        box.blockSignals(False)
