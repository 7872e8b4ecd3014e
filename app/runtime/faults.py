"""What the machine can do to a run, said in one line: resources that run out (a full disk, a
quota, a read-only folder, a name the file system cannot hold) and signals that stop it.

SIGINT and SIGTERM both raise ``Stopped`` (a KeyboardInterrupt) in the main thread, so every
command ends a run the way Ctrl+C does: what is buffered is written, files are closed, the
summary is printed, and the exit code is 128 + the signal's number (130, 143).
"""
from __future__ import annotations

import errno
import signal

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


def raise_stopped(signum, _frame) -> None:
    raise Stopped(signum)


def stop_on_signals() -> dict:
    """SIGINT and SIGTERM raise Stopped in the main thread from now on; returns the handlers they
    had, for ``restore``. Call ``take_held_signals`` next, inside the code that handles Stopped."""
    return {s: signal.signal(s, raise_stopped) for s in STOP_SIGNALS}


def take_held_signals() -> None:
    """Unblock SIGINT and SIGTERM (main.py holds them while the modules import): one that
    arrived meanwhile raises Stopped here."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))


def restore(handlers: dict) -> None:
    for s, h in handlers.items():
        signal.signal(s, h)


def resource_message(e: BaseException, path=None) -> str | None:
    """'no space left on the device: out.csv' for an OSError of a resource that ran out (the
    path the error names, else ``path``); None for any other error."""
    if not isinstance(e, OSError) or e.errno not in RESOURCES:
        return None
    where = e.filename if e.filename is not None else path
    return RESOURCES[e.errno] + (f": {where}" if where is not None else "")
