"""Helpers of the tests that watch real processes through /proc."""
import os
import time


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (exited, waiting to be reaped)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and (_stat(int(d)) or [None, None])[1] == str(pid)]


def descendants(pid: int) -> list[int]:
    """Processes below ``pid``: its children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def name_of(pid: int) -> str | None:
    """The process's name (``ps``'s COMMAND, 15 characters at most), or None if gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return None


def gone_within(pid: int, seconds: float) -> bool:
    """Whether the process ends (or is a zombie) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)
