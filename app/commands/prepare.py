"""`nystream prepare`: build this machine's compiled forms ahead of need (what `make run` does
after installing): the models' numba kernels and the musicnn front end's one-stream push
(AOTInductor), each once per machine and code, kept in the user's cache; quick when they are
there. Without it the app builds them in the background on first use, serving with the forms
that need no compiling until then (docs/front-ends.md)."""
from __future__ import annotations

import sys
import time
import warnings

from . import command


def add_arguments(p) -> None:
    p.add_argument("--precision", action="append", choices=("float32", "bf16"),
                   help="musicnn precisions to build the compiled push for; repeat for more (default: float32)")
    p.add_argument("--threads", action="append", type=int, metavar="N",
                   help="torch thread counts to build the compiled push for (inductor writes the count into its "
                        "kernels); repeat for more (default: 1, the window's engine, and torch's own count here, "
                        "which classify and the benches run with)")


def say(what: str, work) -> str:
    """One line per form: what it is, then (on a terminal, on the same line) how it went."""
    tty = sys.stderr.isatty()
    if tty:
        print(f"# {what}: ...", end="", flush=True, file=sys.stderr)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)         # torch.export's own deprecations
        done = work()
    line = f"{what}: {done} ({time.perf_counter() - t0:.1f} s)"
    print(f"{chr(13) if tty else ''}# {line}", file=sys.stderr)
    return line


def push_threads() -> list[int]:
    """The thread counts the app runs one stream's push with: the window's engine process, and
    torch's default (``classify``, the benches)."""
    import torch

    from app.runtime.engine_process import ENGINE_THREADS
    return sorted({ENGINE_THREADS, torch.get_num_threads()})


def prepare_all(precisions=("float32",), threads=None) -> list[str]:
    """Every compiled form built where missing, here (a process of the caller's priority, never
    beside a hop or a timed part); one line each, as printed."""
    from audio.musicnn import precision_problem
    from audio.musicnn.graph import prepare as prepare_pushes
    from app.runtime.kernels import prepare as prepare_kernels
    lines = [say("the models' compiled kernels (numba, once per machine)", prepare_kernels)]
    for mode in precisions:
        problem = precision_problem(mode, "cpu")           # built all the same: its tests run it emulated
        for n in threads or push_threads():
            lines.append(say(f"the musicnn push, {mode}, {n} thread{'s' * (n > 1)} (AOTInductor, once per machine)",
                             lambda mode=mode, n=n, problem=problem:
                             prepare_pushes(n, mode=mode) + (f"; {problem}" if problem else "")))
    return lines


@command("prepare", add_arguments)
def run(args) -> int:
    prepare_all(args.precision or ["float32"], args.threads)
    return 0
