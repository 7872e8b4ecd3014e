"""Checkpoints: config + weights (fixed landmarks included) + metadata, loadable with
``torch.load(weights_only=True)``; a checkpoint that does not match what the caller expects is
refused with a CheckpointError that says what differs."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .transformer import GenreTransformer, ModelConfig, build_model

FORMAT = "nystream-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A file that is not a Nystream checkpoint, or one for another model."""
    hint = "Choose a checkpoint made by `python main.py train` for this front end."


def save_checkpoint(model: GenreTransformer, path: str | Path, *, classes: list[str],
                    metadata: dict | None = None, frontend: dict | None = None) -> None:
    """Write model (config, weights, fixed landmarks), class names, the front end its tokens
    came from ({'name', 'token_dim', 'spacing_hops', 'weights', ...}) and metadata atomically.
    A model running on fitted fixed landmarks is saved as a fixed-landmark model (it loads in
    that mode); otherwise the config is saved as it is."""
    path = Path(path)
    cfg = model.cfg
    if model.landmark_mode == "fixed" and model.has_fixed_landmarks:
        cfg = cfg.replace(landmark_mode="fixed")
    payload = {"format": FORMAT, "version": VERSION, "config": cfg.to_dict(),
               "state_dict": model.state_dict(), "classes": [str(c) for c in classes],
               "frontend": plain(frontend or infer_frontend(model.cfg.in_dim)),
               "metadata": plain(metadata or {})}
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def plain(metadata: dict) -> dict:
    """``metadata`` as plain JSON types (numpy scalars become Python numbers), so that it loads
    with ``weights_only=True``."""
    def convert(x):
        if hasattr(x, "item"):
            return x.item()
        if hasattr(x, "tolist"):
            return x.tolist()
        raise TypeError(f"checkpoint metadata holds a {type(x).__name__}, which is not JSON data")
    return json.loads(json.dumps(metadata, default=convert))


def infer_frontend(in_dim: int) -> dict:
    """The front-end record of a checkpoint that has none (made before front ends were
    recorded): the token size tells which (50: musicnn taggrams 4 hops apart, 128: VGGish)."""
    name = {50: "musicnn", 128: "vggish"}.get(in_dim, "unknown")
    return {"name": name, "token_dim": in_dim, "spacing_hops": 4 if name == "musicnn" else 1}


def load_checkpoint(path: str | Path, *, variant: str | None = None, in_dim: int | None = None,
                    classes: list[str] | None = None, frontend: str | None = None,
                    device: str | torch.device = "cpu"):
    """(model in eval mode, payload) from ``path``; checks variant, token dimension, front end
    and classes. ``payload['frontend']`` is always set (inferred for older checkpoints)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path} is not a readable checkpoint ({e})") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a Nystream checkpoint (no '{FORMAT}' header)")
    try:
        cfg = ModelConfig(**payload["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path} has an invalid model config: {e}") from e
    if variant is not None and cfg.variant != variant:
        raise CheckpointError(f"{path} holds a {cfg.variant!r} model, not {variant!r}")
    fe = payload.get("frontend")
    if not isinstance(fe, dict) or "name" not in fe:
        fe = payload["frontend"] = infer_frontend(cfg.in_dim)
    if frontend is not None and fe["name"] != frontend:
        raise CheckpointError(f"{path} was trained on {fe['name']} tokens; run it with "
                              f"--frontend {fe['name']} (this run uses {frontend})")
    if in_dim is not None and cfg.in_dim != in_dim:
        raise CheckpointError(f"{path} expects {cfg.in_dim}-d tokens, these are {in_dim}-d")
    if classes is not None and list(payload.get("classes", [])) != list(classes):
        raise CheckpointError(f"{path} was trained for classes {payload.get('classes')}, "
                              f"expected {list(classes)}")
    model = build_model(cfg)
    try:
        model.load_state_dict(payload["state_dict"])
    except (RuntimeError, KeyError) as e:
        raise CheckpointError(f"{path}: weights do not fit its own config ({e})") from e
    if cfg.landmark_mode == "fixed" and not model.has_fixed_landmarks:
        raise CheckpointError(f"{path} is a fixed-landmark model without fitted landmarks")
    return model.to(device).eval(), payload
