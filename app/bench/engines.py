"""`bench --engines`: the musicnn front end's work run by each inference engine one can build
here, the candidates for compiling it: torch eager (what the app runs), `torch.compile`
(inductor), ONNX Runtime and OpenVINO (when installed: `pip install openvino`), each from the
same float32 module. The parts, at S = 1, 4, 16 and 32 streams computed at once:

* the network recomputing its 3 s patch, (S, 187, 96) log-mel -> (S, 50);
* its head, (S, 187, 561) front-end features -> (S, 50) (mid-end and back-end: what the
  continual push recomputes every hop);
* the continual push's timbral rows for 16 new frames, (S, 22, 96) -> (S, 16, 408)
  (`MusicnnBatch._timbral_rows`, its largest matrix product);
* the whole continual push of a hop of 16 new frames as one graph (audio/musicnn/graph.py:
  the caches in, the caches and taggrams out).

The engines take turns in blocks of calls (each sees the same load), a block starting IDLE_S after
the last (the previous engine's threads go idle) with an untimed call; an engine's first call is timed apart as its
set-up (export, compile). Each last output is compared with the float64 module's, the push's
taggrams with MusicnnBatch's push of the same hop."""
from __future__ import annotations

import copy
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from audio.musicnn import FRONT_CH, PATCH_FRAMES, build_musicnn
from audio.musicnn.batch import EDGE, MusicnnBatch

from audio.musicnn.graph import PushGraph, state_of

ENGINES = ("torch", "torch.compile", "onnxruntime", "openvino")
STREAMS = (1, 4, 16, 32)
NEW_FRAMES = 16
PARTS = ("network, recomputing the 3 s patch", "head (mid-end and back-end)",
         f"timbral rows of {NEW_FRAMES} new frames", f"the continual push as one graph ({NEW_FRAMES} new frames)")
ROUNDS = 2               # each engine's calls in this many blocks, the engines' blocks in turns
IDLE_S = 0.2             # before a block: the previous engine's threads stop spinning


class _Head(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, front):                                 # (S, 187, 561) -> (S, 50)
        return self.net.head(front)


class _TimbralRows(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.batch = MusicnnBatch(net, 1)

    def forward(self, x):                                     # (S, 16 + 6, 96) -> (S, 16, 408)
        return self.batch._timbral_rows(x)


def make_part(part: str, S: int, g: torch.Generator, net) -> tuple[nn.Module, tuple, np.ndarray]:
    """Part ``part`` for S streams: (its float32 module, its inputs, the float64 answer its last
    output is compared with; for the push graph, MusicnnBatch's own push of the same hop)."""
    if part == PARTS[3]:
        fb = MusicnnBatch(net, S)                # S streams' caches three hops into random frames
        for s in range(S):
            fb.reset(s)
        for _ in range(3):
            fb.push(list(range(S)), list(torch.randn(S, NEW_FRAMES, 96, generator=g).numpy()))
        new = torch.randn(S, NEW_FRAMES, 96, generator=g)
        graph = PushGraph(fb, NEW_FRAMES).eval()
        inputs = tuple(x.clone() for x in state_of(fb, range(S))) + (new,)
        return graph, inputs, fb.push(list(range(S)), list(new.numpy())).double().numpy()
    wrap, shape = {PARTS[0]: (lambda n: n, (PATCH_FRAMES, 96)), PARTS[1]: (_Head, (PATCH_FRAMES, FRONT_CH)),
                   PARTS[2]: (_TimbralRows, (NEW_FRAMES + 2 * EDGE, 96))}[part]
    x = torch.randn(S, *shape, generator=g)
    exact = wrap(copy.deepcopy(net).double()).eval()
    return wrap(net).eval(), (x,), exact(x.double()).numpy()


def _last(out):
    return out[-1] if isinstance(out, (tuple, list)) else out


def _runner(engine: str, module: nn.Module, inputs: tuple, path: Path, threads: int):
    """A call of ``module`` on arrays shaped as ``inputs`` by ``engine`` (numpy in, its last
    output out), or None where the engine is not installed; ``path``: the ONNX export, made by
    the first engine that reads it."""
    if engine == "torch":
        return lambda *a: _last(module(*map(torch.from_numpy, a))).numpy()
    if engine == "torch.compile":
        from audio.musicnn.graph import one_compile_worker
        one_compile_worker()                       # no pool of compile workers busy beside the timings
        compiled = torch.compile(module, dynamic=False)
        return lambda *a: _last(compiled(*map(torch.from_numpy, a))).numpy()
    if engine == "openvino":
        try:
            import openvino
        except ImportError:
            return None
    if not path.exists():
        torch.onnx.export(module, inputs, str(path), dynamo=True, verbose=False)
    if engine == "onnxruntime":
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")   # no spinning between calls
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        return lambda *a: session.run(None, dict(zip(names, a)))[-1]
    model = openvino.Core().compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                             "INFERENCE_PRECISION_HINT": "f32"})
    request = model.create_infer_request()
    return lambda *a: request.infer(dict(enumerate(a)))[model.outputs[-1]].copy()


@torch.no_grad()
def measure(part: str, S: int, engines, calls: int, threads: int) -> tuple[list[dict], list[str]]:
    """One part at S streams by each engine, in this process: its rows, and the engines missing."""
    torch.set_num_threads(threads)
    net, _ = build_musicnn()
    net.requires_grad_(False)
    g = torch.Generator().manual_seed(1000 * PARTS.index(part) + S)
    module, inputs, want = make_part(part, S, g, net)
    arrays = [x.numpy() for x in inputs]
    runners, setup, missing = {}, {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:
            t0 = time.perf_counter()
            run = _runner(engine, module, inputs, Path(tmp) / "part.onnx", threads)
            if run is None:
                missing.append(engine)
                continue
            out = run(*arrays)                                  # the first call: set-up too
            setup[engine] = time.perf_counter() - t0
            runners[engine] = (run, float(np.abs(out.astype(np.float64) - want).max()))
        times = {e: [] for e in runners}
        for _ in range(ROUNDS):                     # blocks in turns, apart: an engine's idle
            for engine, (run, _) in runners.items():             # (spinning) threads never overlap another's
                time.sleep(IDLE_S)
                run(*arrays)
                for _ in range(max(1, calls // ROUNDS)):
                    t0 = time.perf_counter()
                    run(*arrays)
                    times[engine].append(time.perf_counter() - t0)
    rows = [{"part": part, "streams": S, "engine": engine, "median_ms": 1e3 * statistics.median(times[engine]),
             "setup_s": setup[engine], "max_abs_diff": diff, "reference_max_abs": float(np.abs(want).max())}
            for engine, (_, diff) in runners.items()]
    return rows, missing


def engines_bench(streams=STREAMS, engines=ENGINES, calls: int = 10, threads: int | None = None,
                  only: str | tuple[str, ...] = "") -> dict:
    """Rows of (part, streams, engine) for the parts whose name holds ``only`` (or one of them),
    each part and stream count in a fresh process (no heap or thread pool left by another):
    median ms of ``calls`` calls (in ROUNDS blocks taken in turns), set-up s, the largest
    difference from the reference; engines not installed are listed apart."""
    threads = threads or torch.get_num_threads()
    wanted = [p for p in PARTS if any(o in p for o in ((only,) if isinstance(only, str) else only))]
    rows, missing = [], set()
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for part in wanted:
            for S in streams:
                got, gone = pool.apply(measure, (part, S, tuple(engines), calls, threads))
                rows += got
                missing.update(gone)
    versions = {"torch": torch.__version__}
    for name in ("onnxruntime", "openvino"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    return {"rows": rows, "threads": threads, "calls": calls, "missing": sorted(missing), "versions": versions}


def print_engines(r: dict) -> None:
    print(f"musicnn's parts by engine ({r['threads']} threads, median of {r['calls']} calls in {ROUNDS} blocks taken in turns):")
    for row in r["rows"]:
        print(f"  {row['part']:<40} S={row['streams']:<3} {row['engine']:<14} {row['median_ms']:9.2f} ms"
              f"  set-up {row['setup_s']:6.1f} s  max |diff| {row['max_abs_diff']:.1e}")
    if r["missing"]:
        print(f"  not installed: {', '.join(r['missing'])}")


def engines_table(d: dict) -> str:
    """The benchmark page's tables of a run: per part, each engine's median by stream count."""
    engines = [x for x in ENGINES if any(r["engine"] == x for r in d["rows"])]
    out = []
    for part in dict.fromkeys(r["part"] for r in d["rows"]):
        rows = [r for r in d["rows"] if r["part"] == part]
        out += [f"**{part}**: median ms (in brackets: torch's time over the engine's)", "",
                "| streams | " + " | ".join(engines) + " |", "| ---: |" + " ---: |" * len(engines)]
        for S in sorted({r["streams"] for r in rows}):
            by = {r["engine"]: r for r in rows if r["streams"] == S}
            base = by["torch"]["median_ms"] if "torch" in by else None
            cells = [(f"{by[x]['median_ms']:.2f}" + (f" ({base / by[x]['median_ms']:.2f}x)" if base else ""))
                     if x in by else "–" for x in engines]
            out.append(f"| {S} | " + " | ".join(cells) + " |")
        ran = [x for x in engines if any(r["engine"] == x for r in rows)]
        worst = {x: max(r["max_abs_diff"] for r in rows if r["engine"] == x) for x in ran}
        setup = {x: max(r["setup_s"] for r in rows if r["engine"] == x) for x in ran}
        reference = "the app's push of the same hop" if "push as one graph" in part else "the float64 module"
        out += ["", f"Largest difference from {reference}: "
                + ", ".join(f"{x} {v:.1e}" for x, v in worst.items()) + ". Set-up (the first call: export, "
                "compile; the export is made once, by the first engine that reads it), largest: " + ", ".join(f"{x} {v:.1f} s" for x, v in setup.items()) + ".", ""]
    versions = ", ".join(f"{k} {v}" for k, v in d["versions"].items())
    missing = f" Not installed in this run: {', '.join(d['missing'])}." if d["missing"] else ""
    out.append(f"{d['threads']} threads, the median of {d['calls']} calls in two blocks an engine, the engines' "
               f"blocks taken in turns; {versions}.{missing}")
    return "\n".join(out) + "\n"
