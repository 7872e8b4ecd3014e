"""One writer per output: `extract`, `train` and `sweep` hold a lock beside what they write
(``.<name>.lock``, holding the process id and command), taken with ``flock`` so that a run that
dies, even by SIGKILL, leaves a stale file that the next run detects and takes over. A second run
on the same output refuses at once, naming the running one."""
from __future__ import annotations

import fcntl
import os
import sys
from contextlib import contextmanager
from pathlib import Path


class OutputLocked(RuntimeError):
    """Another run is writing this output."""


def lock_path(path) -> Path:
    p = Path(path)
    return p.with_name(f".{p.name}.lock")


@contextmanager
def output_lock(path, command: str):
    """Hold the lock of ``path`` (a file or folder to be written) while the block runs."""
    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise OutputLocked(f"{path} is being written by {holder}; wait for it to finish, or stop "
                               f"it, then run this again") from None
        stale = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if stale:
            print(f"# {lock}: a stale lock of {stale} (not running) was taken over", file=sys.stderr)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} ({command})\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            lock.unlink(missing_ok=True)
    finally:
        os.close(fd)
