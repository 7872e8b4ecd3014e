"""What the window starts with and remembers: command-line Options over saved QSettings."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

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
    autostart: bool = True


def load_settings(w) -> None:
    """Restore the window's controls from its QSettings."""
    s = w.settings
    w.set_source_kind(saved_kind(s.value("source/kind", SourceKind.DEMO.value)))
    device = s.value("source/device", "")
    if device and w.device_box.findText(device) >= 0:
        w.device_box.setCurrentIndex(w.device_box.findText(device))
    path = s.value("source/file", "")
    if path and Path(path).is_file():
        w.set_file(path)
    w.loop_box.setChecked(s.value("source/loop", "true") in ("true", True))
    saved = s.value("models/variants", None)
    tick(w, list(VARIANTS) if saved is None else [v for v in str(saved).split(",") if v])
    w.layers_box.setValue(int(s.value("models/layers", 1)))
    w.window_box.setValue(int(s.value("models/window", 120)))
    w.landmarks_box.setValue(int(s.value("models/landmarks", 4)))
    w.smooth_box.setValue(float(s.value("view/smoothing_s", 5.0)))
    w.cost.restore(s)
    w.table.restore(s)
    i = w.compute_box.findData(s.value("compute", "cuda" if torch.cuda.is_available() else "cpu"))
    w.compute_box.setCurrentIndex(max(i, 0))
    i = w.frontend_box.findData(s.value("frontend", DEFAULT_FRONTEND))
    w.frontend_box.setCurrentIndex(max(i, 0))


def save_settings(w) -> None:
    s = w.settings
    s.setValue("source/kind", w.source_kind.currentData())
    s.setValue("source/device", w.device_box.currentText())
    s.setValue("source/file", w.file_path or "")
    s.setValue("source/loop", w.loop_box.isChecked())
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


def saved_kind(value) -> SourceKind:
    """A saved source kind: its name ('demo' / 'mic' / 'file'), or an older index 0-2."""
    kinds = list(SourceKind)
    if str(value).isdigit():
        return kinds[min(int(value), len(kinds) - 1)]
    try:
        return SourceKind(str(value))
    except ValueError:
        return SourceKind.DEMO
