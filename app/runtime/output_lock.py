"""One writer per output: `extract`, `train` and `sweep` hold a lock beside what they write
(``.<name>.lock``, holding the process id and command), taken with ``flock`` so that a run that
dies, even by SIGKILL, leaves a stale file that the next run detects and takes over. A second run
on the same output refuses at once, naming the running one. A file system without locks (some
network and FUSE mounts answer ENOLCK or EOPNOTSUPP) gets a one-line note and no lock. The lock
file is removed at the end; a run that locked a file just removed tries again on the new one."""
from __future__ import annotations

import errno
import fcntl
import os
import stat
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
    fd = take(lock, path)
    if fd is None:
        yield
        return
    try:
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


def open_lock(lock: Path) -> int:
    """The lock file opened for reading and writing: a regular file, never through a link (a
    planted link would have the run truncate its target) nor a FIFO or device."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EISDIR):
            raise OutputLocked(f"{lock} is not a regular file (a link, folder or device); remove it, "
                               f"then run this again") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OutputLocked(f"{lock} is not a regular file (a link, folder or device); remove it, "
                           f"then run this again")
    return fd


def take(lock: Path, path) -> int | None:
    """The lock file's descriptor, locked; None where the file system has no locks."""
    while True:
        fd = open_lock(lock)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise OutputLocked(f"{path} is being written by {holder}; wait for it to finish, or stop "
                               f"it, then run this again") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                raise
            print(f"# {lock}: this file system does not lock files ({e.strerror}); two runs on "
                  f"{path} at once would not be detected", file=sys.stderr)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)                            # the run before removed it as we locked it
