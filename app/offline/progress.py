"""Progress with an ETA for long offline work (extract, train, evaluate): a tqdm bar on stderr
when stderr is a terminal (the work's lines printed above it); on a pipe or a file no bar, and
each line ends with the time so far and the time left."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """``total`` items of ``unit``; ``log`` takes the lines when there is no bar."""

    def __init__(self, total: int | None, desc: str, unit: str, log):
        """``total`` None: not known (a count and a rate, no ETA); 0: no progress at all."""
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr,
                        disable=None if total != 0 else True, dynamic_ncols=True)
        self.log, self.total, self.done, self.t0 = log, total, 0, time.monotonic()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.bar.close()

    def eta(self) -> str:
        """'12 s so far, ~30 s left' (the rate so far, extrapolated)."""
        elapsed = time.monotonic() - self.t0
        if not self.total:
            return f"{elapsed:.0f} s so far"
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        return f"{elapsed:.0f} s so far, ~{left:.0f} s left"

    def say(self, line: str) -> None:
        """A line that counts nothing (a note)."""
        if self.bar.disable:
            self.log(line)
        else:
            self.bar.write(line, file=sys.stderr)

    def step(self, line: str = "") -> None:
        """One item done, with its line."""
        self.done += 1
        if self.total == 0:
            return
        if self.bar.disable:
            if line:
                self.log(f"{line} ({self.eta()})")
        else:
            if line:
                self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
