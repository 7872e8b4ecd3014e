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


def paired_medians(fn_a, fn_b, budget_s: float, block_a: int = 100, block_b: int = 2,
                   rounds: int = 200) -> tuple[float, float]:
    """Median microseconds of ``fn_a`` and ``fn_b`` timed in alternating blocks (block_a calls
    of one, block_b of the other) for at most ``budget_s``, so both see the same machine load:
    their ratio holds on a host whose speed drifts between rows (+-30 % here). Blocks of 100:
    the first steps after the other function's block find cold caches, which a median over 100
    absorbs (with blocks of 20, 1-block fused steps read ~15 % slower when tried during
    development)."""
    times: tuple[list, list] = ([], [])
    deadline = time.perf_counter() + budget_s
    for _ in range(rounds):
        for fn, count, out in ((fn_a, block_a, times[0]), (fn_b, block_b, times[1])):
            for _ in range(count):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
                if len(out) >= 10 and t0 > deadline:      # a slow step: cut the block short
                    break
        if time.perf_counter() > deadline and len(times[1]) >= 5:
            break
    return statistics.median(times[0]) * 1e6, statistics.median(times[1]) * 1e6
