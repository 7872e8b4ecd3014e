"""Crash-safe writes: a file is written beside its final name, fsynced, renamed over it, and its
directory fsynced, so that a crash or a full disk leaves the old file or the new one, never a
part of one. Used for token files and parts, manifests, reports and checkpoints."""
from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import AudioError


class UnsafePathError(AudioError):
    """A folder the app writes into that is a link (it would write through it elsewhere)."""


def own_folder(folder: Path) -> Path:
    """``folder`` made if absent; refused (UnsafePathError) if it is a link or not a folder."""
    if folder.is_symlink():
        raise UnsafePathError(f"{folder} is a link; the app writes its parts only into a folder of "
                              f"its own: remove the link, then run this again")
    folder.mkdir(parents=True, exist_ok=True)
    if not folder.is_dir() or folder.is_symlink():
        raise UnsafePathError(f"{folder} is not a folder: remove it, then run this again")
    return folder


def temporary_path(path: Path) -> Path:
    """The name a write to ``path`` goes through (``.NAME.PID.tmp`` beside it; an error that
    names it is reported with ``path``, app/runtime/faults.asked_for)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()      # what the finished file gets (the temporary is 0600)


def exclusive(tmp: Path) -> int:
    """Create ``tmp`` for writing: a new regular file (O_EXCL: never one that exists, O_NOFOLLOW:
    never through a link), mode 0600 while it is written. A leftover of a crashed run with the
    same process id, or a link planted in its place, is removed (the link, not its target) first."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(tmp, flags, 0o600)
    except FileExistsError:
        os.unlink(tmp)
        return os.open(tmp, flags, 0o600)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """``write(f)`` into a temporary file, then make it ``path`` atomically and durably."""
    def save(tmp: Path) -> None:
        with os.fdopen(exclusive(tmp), "wb") as f:
            write(f)
    return atomic_save(path, save, created=True)


def atomic_save(path: str | Path, save: Callable[[Path], None], created: bool = False) -> Path:
    """``save(tmp)`` writes the file at a temporary path (a library that takes a file name; the
    temporary is created here first, see ``exclusive``, unless ``created``), which is then
    fsynced, given the usual mode and renamed to ``path``; nothing is left of a failed write."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        if not created:
            os.close(exclusive(tmp))
        save(tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{tmp} is not a regular file")
            os.fchmod(fd, FILE_MODE)
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
    """UTF-8; a name that is not UTF-8 (surrogates from the file system) keeps its bytes."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8", "surrogateescape")))


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
