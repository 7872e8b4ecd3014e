"""Which models run: the trained checkpoints shipped in ``assets/models/`` (the default), given
checkpoints, and untrained models of chosen variants, each fed tokens of the front end and at
the spacing it was trained on. Used by ``classify``, the window and the benches."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from audio.assets import assets_dir
from audio.gtzan import GENRES
from audio.frontends import token_dim
from app.checkpoint import CheckpointError, load_checkpoint
from models.transformer import ModelConfig, build_model

ASSETS = assets_dir() / "models"
UNTRAINED_WINDOW = {"musicnn": 29, "vggish": 120}     # default n of untrained models


@dataclass(frozen=True)
class ModelSpec:
    """A model described so that another process can build it: a checkpoint file (validated by
    the checkpoint loader where it is built) or the config of an untrained, seeded model."""
    checkpoint: str = ""
    config: ModelConfig | None = None
    seed: int = 0
    device: str = "cpu"
    onnx: str = ""                 # an exported step (app/runtime/onnx_step.py), CPU

    def build(self, frontend: str) -> torch.nn.Module:
        """The model; a checkpoint must have been trained on ``frontend`` (CheckpointError)."""
        if self.onnx:
            return load_onnx(self.onnx, frontend).model
        if self.checkpoint:
            return load_checkpoint(self.checkpoint, frontend=frontend, device=self.device)[0]
        return build_model(self.config, seed=self.seed).to(self.device)


@dataclass
class Entry:
    name: str
    model: torch.nn.Module
    trained: bool
    spacing: int                 # hops between the model's tokens
    frontend: str | None         # front end the model was trained on (None: untrained)
    path: str = ""
    classes: tuple[str, ...] = field(default=GENRES)   # class names (a checkpoint's own)
    test_accuracy: float = 0.0   # what its checkpoint records (0: none)

    def spec(self, device) -> ModelSpec:
        """How another process builds this trained model (from its checkpoint or ONNX file)."""
        if self.path.endswith(".onnx"):
            return ModelSpec(onnx=self.path)
        return ModelSpec(checkpoint=self.path, device=str(device))


def shipped_checkpoints(frontend: str) -> list[Path]:
    """The shipped checkpoints for ``frontend`` (assets/models/<frontend>-*.pt), in a fixed order."""
    order = ("regular", "continual", "nystrom", "continual_nystrom", "continual_nystrom-fixed")
    found = {p.stem.split("-", 1)[1]: p for p in ASSETS.glob(f"{frontend}-*.pt")}
    return [found[k] for k in order if k in found] + sorted(p for k, p in found.items() if k not in order)


CHEAPEST_FIRST = ("continual_nystrom/fixed", "continual_nystrom", "continual", "nystrom", "regular")   # SDA FLOPs a step


class UnknownModelError(ValueError):
    """A model asked for by name that is not shipped."""


def best_shipped(entries: list[Entry]) -> Entry:
    """The shipped model ``classify`` runs by default: the highest test accuracy its checkpoint
    records, the cheaper step (fewer SDA FLOPs) on a tie."""
    def key(e: Entry):
        cost = CHEAPEST_FIRST.index(e.name) if e.name in CHEAPEST_FIRST else len(CHEAPEST_FIRST)
        return -round(e.test_accuracy, 6), cost
    return min(entries, key=key)


def choose_shipped(entries: list[Entry], models) -> list[Entry]:
    """``models``: None or "all" (every shipped model), "best" (``best_shipped``), or names;
    UnknownModelError for a name that is not shipped."""
    if models is None or models == "all" or not entries:
        return entries
    if models == "best":
        return [best_shipped(entries)]
    known = {e.name: e for e in entries}
    missing = [m for m in models if m not in known]
    if missing:
        raise UnknownModelError(f"no shipped model {', '.join(missing)}; shipped: {', '.join(known)}")
    return [known[m] for m in models]


def unique(name: str, taken) -> str:
    while name in taken:
        name += "'"
    return name


def load_trained(path, frontend: str, device, taken=()) -> Entry:
    """A checkpoint as an Entry named by its config's key; CheckpointError if it was trained on
    another front end."""
    model, payload = load_checkpoint(path, frontend=frontend, device=device)
    fe = payload["frontend"]
    classes = tuple(payload.get("classes") or GENRES)
    metrics = (payload.get("metadata") or {}).get("metrics") or {}
    return Entry(unique(model.cfg.key, taken), model, True, int(fe.get("spacing_hops", 1)),
                 fe["name"], str(path), classes, float(metrics.get("test_acc") or 0.0))


def load_onnx(path, frontend: str, taken=()) -> Entry:
    """An exported step (`main.py export`) as an Entry named ``onnx:<its key>``; OnnxModelError
    if it is not one, CheckpointError if it was trained on another front end."""
    from .onnx_step import OnnxStep
    model = OnnxStep(path)
    fe = model.frontend
    if fe.get("name") != frontend:
        raise CheckpointError(f"{path} was exported from a model trained on {fe.get('name')} "
                              f"tokens; run it with --frontend {fe.get('name')} (this run uses {frontend})")
    return Entry(unique(f"onnx:{model.cfg.key}", taken), model, True, int(fe.get("spacing_hops", 1)),
                 fe["name"], str(path), model.classes)


def untrained(variant: str, frontend, device, *, layers: int = 1, window: int | None = None,
              landmarks: int = 4, seed: int = 0, name: str | None = None) -> Entry:
    """A seeded, randomly initialised model for ``frontend``'s tokens at its native spacing."""
    n = window or UNTRAINED_WINDOW.get(frontend.name, 120)
    cfg = untrained_config(variant, frontend.token_dim, layers=layers, window=n, landmarks=landmarks)
    return Entry(name or cfg.key, build_model(cfg, seed=seed).to(device), False,
                 frontend.native_spacing, None)


def untrained_config(variant: str, token_dim: int, *, layers: int, window: int,
                     landmarks: int) -> ModelConfig:
    """The config of an untrained model of ``variant`` (m clipped to the window)."""
    return ModelConfig(variant=variant, in_dim=token_dim, layers=layers, window=window,
                       num_landmarks=min(landmarks, window))


def default_lineup(frontend, device, *, checkpoints=(), variants=None, onnx=(), models=None,
                   **shape) -> list[Entry]:
    """Given checkpoints, else the shipped ones for this front end (``models``: which of them,
    as ``choose_shipped``); plus untrained ``variants`` (None: every variant when no trained
    model exists, else none); plus exported ``onnx`` steps."""
    from models.sda import VARIANTS
    paths = list(checkpoints) or shipped_checkpoints(frontend.name)
    entries: list[Entry] = []
    for p in paths:
        entries.append(load_trained(p, frontend.name, device, [e.name for e in entries]))
    if not checkpoints:
        entries = choose_shipped(entries, models)
    for p in onnx:
        entries.append(load_onnx(p, frontend.name, [e.name for e in entries]))
    if variants is None:
        variants = [] if entries else list(VARIANTS)
    for v in variants:
        e = untrained(v, frontend, device, **shape)
        if e.name in [x.name for x in entries]:
            e.name += " (untrained)"
        entries.append(e)
    return entries


class ShippedLineup:
    """What ticked variants run, for the window: the shipped trained models of the front end
    (loaded once per front end and device) where there are any, else untrained models of the
    chosen shape. ``on_error(message)`` hears about a shipped file that cannot be loaded."""

    def __init__(self, on_error=lambda message: None):
        self.on_error = on_error
        self._loaded: dict[tuple, list[Entry]] = {}

    def shipped(self, frontend: str, device) -> dict[str, list[Entry]]:
        """variant -> the shipped trained models of ``frontend``."""
        key = (frontend, str(device))
        if key not in self._loaded:
            entries = []
            for p in shipped_checkpoints(frontend):
                try:
                    entries.append(load_trained(p, frontend, device))
                except CheckpointError as e:
                    self.on_error(f"Shipped model {p.name} cannot be loaded: {e}")
            self._loaded[key] = entries
        out: dict[str, list[Entry]] = {}
        for e in self._loaded[key]:
            out.setdefault(e.model.cfg.variant, []).append(e)
        return out

    def wanted(self, frontend: str, device, ticked, *, layers: int, window: int,
               landmarks: int) -> dict[str, Entry | ModelConfig]:
        """name -> a shipped Entry, or the ModelConfig of an untrained model to build."""
        shipped = self.shipped(frontend, device)
        wanted: dict[str, Entry | ModelConfig] = {}
        for v in ticked:
            if v in shipped:
                wanted.update({e.name: e for e in shipped[v]})
            else:
                cfg = untrained_config(v, token_dim(frontend), layers=layers, window=window,
                                       landmarks=landmarks)
                wanted[cfg.key] = cfg
        return wanted
