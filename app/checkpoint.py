"""Checkpoints: config + weights (fixed landmarks included) + metadata, loadable with
``torch.load(weights_only=True)``; a checkpoint that does not match what the caller expects is
refused with a CheckpointError that says what differs."""
from __future__ import annotations

import json
import os
import reprlib
import zipfile
from dataclasses import fields
from pathlib import Path

import torch

from audio.files import atomic_save, exclusive
from models.config import MAX_PARAMETERS, ModelConfig
from models.transformer import GenreTransformer, build_model

FORMAT = "nystream-checkpoint"
VERSION = 1
MAX_SPACING_HOPS = 64                             # 16 s between a model's tokens
MAX_FILE_BYTES = 4 * MAX_PARAMETERS + 2**26     # float32 weights of the largest model, and room


class CheckpointError(ValueError):
    """A file that is not a Nystream checkpoint, or one for another model."""
    hint = "Choose a checkpoint made by `python main.py train` for this front end."


def save_checkpoint(model: GenreTransformer, path: str | Path, *, classes: list[str],
                    metadata: dict | None = None, frontend: dict | None = None) -> None:
    """Write model (config, weights, fixed landmarks), class names, the front end its tokens
    came from ({'name', 'token_dim', 'spacing_hops', 'weights', ...}) and metadata atomically
    (audio/files.py: written beside it, fsynced, renamed). A model running on fitted fixed
    landmarks is saved as a fixed-landmark model (it loads in that mode); otherwise the config is
    saved as it is.
    Non-finite weights are refused (CheckpointError): such a model answers NaN. The file is
    read back through ``validated`` (the check every loader makes) before it takes ``path``."""
    path = Path(path)
    cfg = model.cfg
    if model.landmark_mode == "fixed" and model.has_fixed_landmarks:
        cfg = cfg.replace(landmark_mode="fixed")
    state = model.state_dict()
    for key, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"not saving {path}: weight {key!r} holds "
                                  f"{int((~torch.isfinite(t)).sum())} non-finite values")
    payload = {"format": FORMAT, "version": VERSION, "config": cfg.to_dict(),
               "state_dict": state, "classes": [str(c) for c in classes],
               "frontend": plain(frontend or infer_frontend(model.cfg.in_dim)),
               "metadata": plain(metadata or {})}

    def write(tmp: Path) -> None:
        with os.fdopen(exclusive(tmp), "wb") as f:
            torch.save(payload, f)
        try:                                     # what the loaders refuse is never written
            validated(path, torch.load(tmp, map_location="cpu", weights_only=True))
        except CheckpointError as e:
            raise CheckpointError(f"not saving: {e}") from e
    atomic_save(path, write, created=True)


def checkpoint_bytes(cfg: ModelConfig) -> int:
    """About the size of a checkpoint of ``cfg``: its weights, and 1 MiB for the metadata."""
    return sum(t.numel() * t.element_size() for t in build_model(cfg).state_dict().values()) + 2**20


def plain(metadata: dict) -> dict:
    """``metadata`` as plain JSON types (numpy scalars become Python numbers), so that it loads
    with ``weights_only=True``."""
    def convert(x):
        if hasattr(x, "item"):
            return x.item()
        if hasattr(x, "tolist"):
            return x.tolist()
        raise TypeError(f"checkpoint metadata holds a {type(x).__name__}, which is not JSON data")
    return json.loads(json.dumps(metadata, default=convert, allow_nan=False))


def infer_frontend(in_dim: int) -> dict:
    """The front-end record of a checkpoint that has none (made before front ends were
    recorded): the token size tells which (50: musicnn taggrams 4 hops apart, 128: VGGish)."""
    name = {50: "musicnn", 128: "vggish"}.get(in_dim, "unknown")
    return {"name": name, "token_dim": in_dim, "spacing_hops": 4 if name == "musicnn" else 1}


def load_checkpoint(path: str | Path, *, variant: str | None = None, in_dim: int | None = None,
                    classes: list[str] | None = None, frontend: str | None = None,
                    device: str | torch.device = "cpu", fused: bool = True):
    """(model in eval mode, payload) from ``path``; every field is type- and range-checked
    (``validated``), then variant, token dimension, front end and classes are checked against
    what the caller expects. ``payload['frontend']`` is always set (inferred for older files).
    The model steps in the fused CPU kernel where it applies (``fused=False``: the torch
    reference path; ``model.use_fused(False)`` switches later)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise CheckpointError(f"{path} is {path.stat().st_size / 2**20:,.0f} MB, over the "
                              f"{MAX_FILE_BYTES / 2**20:,.0f} MB a model of at most "
                              f"{MAX_PARAMETERS:,} parameters needs: not loaded")
    check_archive(path)
    try:                                          # mmap: tensors stay in the file until validated
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except PermissionError as e:
        raise CheckpointError(f"{path} cannot be read: permission denied") from e
    except Exception as e:  # noqa: BLE001 - pickle, zip and tensor errors: not a checkpoint
        raise CheckpointError(f"{path} is not a readable checkpoint ({one_line(e)})") from e
    model, payload = validated(path, payload)
    cfg, fe = model.cfg, payload["frontend"]
    if variant is not None and cfg.variant != variant:
        raise CheckpointError(f"{path} holds a {cfg.variant!r} model, not {variant!r}")
    if frontend is not None and fe["name"] != frontend:
        raise CheckpointError(f"{path} was trained on {fe['name']} tokens; run it with "
                              f"--frontend {fe['name']} (this run uses {frontend})")
    if in_dim is not None and cfg.in_dim != in_dim:
        raise CheckpointError(f"{path} expects {cfg.in_dim}-d tokens, these are {in_dim}-d")
    if classes is not None and payload["classes"] != list(classes):
        raise CheckpointError(f"{path} was trained for classes {payload['classes']}, "
                              f"expected {list(classes)}")
    return model.to(device).eval().use_fused(fused), payload


def check_archive(path: Path) -> None:
    """Refuse, before torch reads it, a checkpoint archive that would take more memory than its
    size: every member stored uncompressed (torch.save writes them so), each member inside the
    file, their declared sizes summing to at most the file's own size."""
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{path} is not a readable checkpoint (not a torch.save archive: {one_line(e)})") from e
    except PermissionError as e:
        raise CheckpointError(f"{path} cannot be read: permission denied") from e
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({one_line(e)})") from e
    total = 0
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{path}: member {m.filename[:80]!r} is compressed; a checkpoint's "
                                  f"members are stored as written by torch.save: not loaded")
        if m.file_size != m.compress_size or m.header_offset + m.compress_size > size:
            raise CheckpointError(f"{path}: member {m.filename[:80]!r} declares {m.file_size:,} bytes "
                                  f"that the file does not hold: not loaded")
        total += m.file_size
    if total > size:
        raise CheckpointError(f"{path}: its members declare {total:,} bytes in a {size:,}-byte file: not loaded")


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


def validated(path: Path, payload) -> tuple[GenreTransformer, dict]:
    """The model a loaded ``payload`` describes, every field checked; a CheckpointError naming
    ``path`` and the field otherwise."""
    def bad(field: str, what: str) -> CheckpointError:
        return CheckpointError(f"{path}: field '{field}' {what}")

    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a Nystream checkpoint (its field 'format' is not '{FORMAT}')")
    version = payload.get("version")
    if type(version) is not int or not 1 <= version <= VERSION:
        raise bad("version", f"must be an integer 1..{VERSION} (this Nystream's format), got {version!r}")
    cfg = checked_config(payload.get("config"), bad)
    check_classes(payload.get("classes"), cfg, bad)
    fe = payload.get("frontend")
    if fe is None:
        fe = payload["frontend"] = infer_frontend(cfg.in_dim)
    check_frontend(fe, cfg, bad)
    if not isinstance(payload.get("metadata", {}), dict):
        raise bad("metadata", f"must be a mapping, got {type(payload['metadata']).__name__}")
    state = payload.get("state_dict")
    if not isinstance(state, dict):
        raise bad("state_dict", f"must be a mapping of weight names to tensors, got {type(state).__name__}")
    model = build_model(cfg)
    expected = model.state_dict()
    missing, extra = sorted(expected.keys() - state.keys()), sorted(map(str, state.keys() - expected.keys()))
    if missing:
        raise bad(f"state_dict.{missing[0]}", "is missing")
    if extra:
        raise bad(f"state_dict.{extra[0]}", "is not a weight of this config")
    for key, want in expected.items():
        t = state[key]
        if not isinstance(t, torch.Tensor) or t.shape != want.shape or t.is_floating_point() != want.is_floating_point():
            raise bad(f"state_dict.{key}", f"must be a {'float' if want.is_floating_point() else want.dtype} "
                                           f"tensor of shape {tuple(want.shape)}, got {short(t)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise bad(f"state_dict.{key}", f"holds {int((~torch.isfinite(t)).sum())} non-finite values")
    model.load_state_dict(state)
    if cfg.landmark_mode == "fixed" and not model.has_fixed_landmarks:
        raise bad("state_dict", "has no fitted landmarks, but config.landmark_mode is 'fixed'")
    return model, payload


def checked_config(config, bad) -> ModelConfig:
    """A model config (a mapping of every ModelConfig field) checked field by field; ``bad(field,
    what)`` makes the error. Shared by checkpoints and exported steps."""
    if not isinstance(config, dict):
        raise bad("config", f"must be a mapping of model settings, got {type(config).__name__}")
    settings = {f.name for f in fields(ModelConfig)}
    unknown, absent = sorted(set(map(str, config)) - settings), sorted(settings - set(config))
    if unknown:
        raise bad(f"config.{unknown[0][:40]}", "is not a model setting")
    if absent:
        raise bad(f"config.{absent[0]}", "is missing (a model file records every model setting)")
    try:
        return ModelConfig(**config)
    except (TypeError, ValueError) as e:
        raise bad("config", f"is invalid: {one_line(e)}") from e


MAX_CLASS_NAME = 64                 # characters: a genre's name, not a document


def check_classes(names, cfg: ModelConfig, bad) -> None:
    """config.num_classes distinct, non-empty, printable UTF-8 names of at most MAX_CLASS_NAME."""
    if (not isinstance(names, list) or len(names) != cfg.num_classes
            or not all(isinstance(c, str) and c.strip() and len(c) <= MAX_CLASS_NAME and utf8(c)
                       and c.isprintable() for c in names)
            or len(set(names)) != len(names)):
        raise bad("classes", f"must be a list of {cfg.num_classes} distinct class names "
                             f"(config.num_classes; printable UTF-8, at most {MAX_CLASS_NAME} "
                             f"characters each), got {short(names)}")


def check_frontend(fe, cfg: ModelConfig, bad) -> None:
    """The front-end record: its 'name', and token_dim / spacing_hops in range where given."""
    if not isinstance(fe, dict) or not isinstance(fe.get("name"), str) or not 0 < len(fe["name"]) <= 40:
        raise bad("frontend", f"must be a mapping with the front end's 'name', got {short(fe)}")
    for key, allowed in (("token_dim", range(cfg.in_dim, cfg.in_dim + 1)),
                         ("spacing_hops", range(1, MAX_SPACING_HOPS + 1))):
        v = fe.get(key)                    # hops between tokens: a model runs that many streams
        if v is not None and (type(v) is not int or v not in allowed):
            raise bad(f"frontend.{key}", f"must be an integer in {allowed.start}..{allowed.stop - 1}, got {short(v)}")


def utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def short(x) -> str:
    """A value, described in a few words for an error message."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    text = SHORT.repr(x)                    # bounded, whatever the nesting (a pickle can share lists)
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


SHORT = reprlib.Repr()
SHORT.maxlevel, SHORT.maxlist, SHORT.maxdict, SHORT.maxstring, SHORT.maxother = 2, 4, 4, 40, 40
