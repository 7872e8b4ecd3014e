"""Process memory that stays flat over long streams, and its measure (``rss_mb``).

glibc raises its mmap threshold each time a large block (a decoded audio block, a tensor) is
freed; later blocks of that size then come from the heap, whose fragments keep the process's
resident memory high: a one-hour file classified with the default grows by half. A fixed threshold returns every large block to
the system when it is freed, and memory stays flat. Commands started from the command line set
it (app/cli.py); a call of ``app.cli.main(argv)`` from Python leaves its process's allocator
alone: page faults of fresh mapped blocks cost a heavy torch workload about a quarter of its
time. (The figures: docs/benchmarks.md, design measurements.)"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024
MANY_STREAMS_MMAP_BYTES = 32 * 2**20              # glibc's largest mmap threshold on 64-bit
MANY_STREAMS_TRIM_BYTES = 64 * 2**20


def glibc_call(name: str, *args: int | bytes) -> int | None:
    """glibc's function ``name`` called with ``args``, its result; None where there is no glibc
    (not Linux, musl, no libc.so.6)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)(*args)
    except (OSError, AttributeError):
        return None


def fixed_mmap_threshold(size: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``size`` bytes; True if set (Linux glibc only)."""
    return glibc_call("mallopt", M_MMAP_THRESHOLD, size) == 1


def many_streams_heap() -> bool:
    """For a process that runs many streams in one engine (serve, ``classify FILE FILE ...``,
    ``bench --streams``): blocks up to 32 MB come from the heap and up to 64 MB of free heap is
    kept, so that each hop's large temporaries (the features and activations of every stream)
    reuse the last hop's memory instead of fresh pages from the system: about half the hop time
    of the fixed threshold, for slightly more resident memory, flat (docs/benchmarks.md, design
    measurements); `bench --streams` on the CPU is measured with it. True if set (Linux glibc only)."""
    return (glibc_call("mallopt", M_MMAP_THRESHOLD, MANY_STREAMS_MMAP_BYTES) == 1
            and glibc_call("mallopt", M_TRIM_THRESHOLD, MANY_STREAMS_TRIM_BYTES) == 1)


def release_free_heap() -> bool:
    """Give the heap's free memory back to the system now (glibc ``malloc_trim``), so that what
    stays resident is what the process holds (``many_streams_heap`` keeps up to 64 MB of it for
    the next hop's temporaries). True if done (Linux glibc only)."""
    return glibc_call("malloc_trim", 0) is not None


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of a process now (MB; Linux /proc; nan if it is gone; elsewhere this
    process's peak so far)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except FileNotFoundError:
        return float("nan")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
