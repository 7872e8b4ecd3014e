"""Timing helpers and the result row of `bench`."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from app.runtime.records import percentile


@dataclass
class Row:
    n: int
    what: str
    median_us: float
    p95_us: float
    flops: int | None = None
    extra: dict = field(default_factory=dict)


def time_steps(fn, steps: int, budget_s: float, after=None) -> tuple[float, float]:
    """Median and p95 of ``fn()`` in microseconds, at most ``steps`` calls or ``budget_s``;
    ``after()`` runs untimed after each call (e.g. reading the step's FLOPs)."""
    times = []
    deadline = time.perf_counter() + budget_s
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after()
        if time.perf_counter() > deadline and len(times) >= 10:
            break
    return statistics.median(times) * 1e6, percentile(times, 0.95) * 1e6


def warm(fn, count: int) -> None:
    """Run ``fn`` ``count`` times, unbudgeted: every timed step must see a full window."""
    for _ in range(count):
        fn()
