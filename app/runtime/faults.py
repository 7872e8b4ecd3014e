"""What the machine can do to a run, said in one line: resources that run out (a full disk, a
quota, a read-only folder, a name the file system cannot hold) and signals that stop it.

SIGINT and SIGTERM both raise ``Stopped`` (a KeyboardInterrupt) in the main thread, so every
command ends a run the way Ctrl+C does: what is buffered is written, files are closed, the
summary is printed, and the exit code is 128 + the signal's number (130, 143).
A stop never lands inside an import: C code that imports a module (an extension module's init, a
library's lazy import) may turn the exception into another one, print it, or drop it. A signal that
comes while a module imports is sent again every ``RETRY_S`` until the import is over. The handler
also remembers every signal (``stop_received``), so that a loop can end a run whose Stopped some
other code swallowed (a ``__del__``, a callback from C): ``raise_if_stopped``.
"""
from __future__ import annotations

import errno
import os
import re
import signal
import sys
import threading
from pathlib import Path

RESOURCES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.ENAMETOOLONG: "file name too long for the file system",
    errno.EFBIG: "file too large for the file system",
}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived (SIGINT: Ctrl+C, SIGTERM: a service stop, `timeout`, a logout)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_name(e: BaseException) -> str:
    return signal.Signals(getattr(e, "signum", signal.SIGINT)).name


def exit_code(e: BaseException) -> int:
    """128 + the signal's number (a KeyboardInterrupt without one: SIGINT, 130)."""
    return 128 + int(getattr(e, "signum", signal.SIGINT))


RETRY_S = 0.05
_received: list[int] = []
_deferred: set[int] = set()          # signals put off until an import is over (sent again)


def raise_stopped(signum, frame) -> None:
    if signum not in _deferred:      # a signal sent again is not a second stop
        _received.append(signum)
    if importing(frame):
        _deferred.add(signum)
        again = threading.Timer(RETRY_S, os.kill, (os.getpid(), signum))
        again.daemon = True
        again.start()
        return
    _deferred.discard(signum)
    raise Stopped(signum)


def importing(frame) -> bool:
    """Whether the interrupted code runs inside an import (importlib's frames on the stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def stop_received() -> Stopped | None:
    """A Stopped for the first stop signal since ``stop_on_signals``, or None if none came."""
    return Stopped(_received[0]) if _received else None


def raise_if_stopped() -> None:
    """Raise the first stop signal's Stopped if one came (one that other code swallowed)."""
    stop = stop_received()
    if stop is not None:
        raise stop


def stop_on_signals() -> dict:
    """SIGINT and SIGTERM raise Stopped in the main thread from now on; returns the handlers they
    had, for ``restore``. Call ``take_held_signals`` next, inside the code that handles Stopped."""
    _received.clear()
    _deferred.clear()
    return {s: signal.signal(s, raise_stopped) for s in STOP_SIGNALS}


def hold_signals() -> None:
    """Block SIGINT and SIGTERM in this thread: they wait, pending, until ``take_held_signals``."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))


def take_held_signals() -> None:
    """Unblock SIGINT and SIGTERM (held while the modules import: main.py, ``hold_signals``):
    one that arrived meanwhile raises Stopped here."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))


def restore(handlers: dict) -> None:
    for s, h in handlers.items():
        signal.signal(s, h)


def stdout_gone() -> int:
    """The reader of stdout went away (``... | head``): point stdout at /dev/null so that nothing
    more fails on it (not even the flush at exit); returns 141, 128 + SIGPIPE, as a shell reports a
    command that a closed pipe ended."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def resource_message(e: BaseException, path=None) -> str | None:
    """'no space left on the device: out.csv' for an OSError of a resource that ran out (the
    path the error names, else ``path``); None for any other error."""
    if not isinstance(e, OSError) or e.errno not in RESOURCES:
        return None
    where = asked_for(e.filename if e.filename is not None else path)
    detail = e.strerror if e.strerror and e.strerror != os.strerror(e.errno) else ""
    return RESOURCES[e.errno] + (f": {where}" if where is not None else "") + (f" ({detail})" if detail else "")


def asked_for(path):
    """The file the user asked for, where ``path`` is an atomic writer's temporary beside it
    (``.NAME.PID.tmp``); ``path`` otherwise."""
    temporary = re.fullmatch(r"\.(.+)\.\d+\.tmp", Path(str(path)).name) if path is not None else None
    return str(Path(str(path)).with_name(temporary[1])) if temporary else path


def check_room(path, need: int, what: str) -> None:
    """OSError(ENOSPC) now if the file system of ``path`` has less than ``need`` bytes free for
    ``what`` (so a long run does not end at its last write)."""
    st = os.statvfs(Path(path).resolve().parent)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(errno.ENOSPC, f"{what} needs about {megabytes(need)}, "
                                    f"{megabytes(free)} are free", str(path))


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
