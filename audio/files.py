"""Crash-safe writes: a file is written beside its final name, fsynced, renamed over it, and its
directory fsynced, so that a crash or a full disk leaves the old file or the new one, never a
part of one. Used for token files and parts, manifests and reports (checkpoints: models/checkpoint.py)."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def temporary_path(path: Path) -> Path:
    """The name a write to ``path`` goes through (``.NAME.PID.tmp`` beside it; an error that
    names it is reported with ``path``, app/runtime/faults.asked_for)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """``write(f)`` into a temporary file, then make it ``path`` atomically and durably."""
    def save(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)
    return atomic_save(path, save)


def atomic_save(path: str | Path, save: Callable[[Path], None]) -> Path:
    """``save(tmp)`` writes the file at a temporary path (a library that takes a file name),
    which is then fsynced and renamed to ``path``; nothing is left of a failed write."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        save(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write_json(path: str | Path, data, indent: int | None = 1) -> Path:
    """Standard JSON only: a NaN or infinite number (a metric with no data) is written as null."""
    return atomic_write_text(path, json.dumps(finite_or_null(data), indent=indent, allow_nan=False))


def finite_or_null(x):
    """``x`` (JSON data) with every non-finite float replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_null(v) for v in x]
    return x


def fsync_dir(folder: str | Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
