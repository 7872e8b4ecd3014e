"""`bench --engines`: the musicnn network's dense parts run by each inference engine one can build
here, the candidates for compiling the front end: torch eager (what the app runs), `torch.compile`
(inductor), ONNX Runtime and OpenVINO (when installed: `pip install openvino`), each from the
same float32 module. The parts, at S = 1, 4, 16 and 32 streams computed at once:

* the network recomputing its 3 s patch, (S, 187, 96) log-mel -> (S, 50);
* its head, (S, 187, 561) front-end features -> (S, 50) (mid-end and back-end: what the
  continual push recomputes every hop);
* the continual push's timbral rows for 16 new frames, (S, 22, 96) -> (S, 16, 408)
  (`MusicnnBatch._timbral_rows`, its largest matrix product).

The engines take turns in blocks of calls (each sees the same load; the untimed first call of a
block lets the previous engine's threads go idle); an engine's first call is timed apart as its
set-up (export, compile). Each output is compared with the float64 module's."""
from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from audio.musicnn import FRONT_CH, PATCH_FRAMES, build_musicnn
from audio.musicnn.batch import EDGE, MusicnnBatch

ENGINES = ("torch", "torch.compile", "onnxruntime", "openvino")
STREAMS = (1, 4, 16, 32)
NEW_FRAMES = 16
ROUNDS = 2               # each engine's calls in this many blocks, the engines' blocks in turns


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


def parts(net) -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """name -> (float32 module, input shape per stream)."""
    return {"network, recomputing the 3 s patch": (net, (PATCH_FRAMES, 96)),
            "head (mid-end and back-end)": (_Head(net), (PATCH_FRAMES, FRONT_CH)),
            f"timbral rows of {NEW_FRAMES} new frames": (_TimbralRows(net), (NEW_FRAMES + 2 * EDGE, 96))}


def _runner(engine: str, module: nn.Module, x: torch.Tensor, path: Path, threads: int):
    """A call of ``module`` on inputs shaped as ``x`` by ``engine`` (numpy in, numpy out), or
    None where the engine is not installed; ``path``: the ONNX export, made by the first engine
    that reads it."""
    if engine == "torch":
        return lambda a: module(torch.from_numpy(a)).numpy()
    if engine == "torch.compile":
        compiled = torch.compile(module, dynamic=False)
        return lambda a: compiled(torch.from_numpy(a)).numpy()
    if engine == "openvino":
        try:
            import openvino
        except ImportError:
            return None
    if not path.exists():
        torch.onnx.export(module, (x,), str(path), dynamo=True, verbose=False)
    if engine == "onnxruntime":
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")   # as torch's pool: idle between calls
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda a: session.run(None, {name: a})[0]
    model = openvino.Core().compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                             "INFERENCE_PRECISION_HINT": "f32"})
    request = model.create_infer_request()
    return lambda a: request.infer({0: a})[0].copy()


@torch.no_grad()
def engines_bench(streams=STREAMS, engines=ENGINES, calls: int = 10, threads: int | None = None,
                  only: str = "") -> dict:
    """Rows of (part, streams, engine): median ms of ``calls`` calls (in ROUNDS blocks taken in turns), set-up s,
    the largest difference from the float64 module; engines not installed are listed apart."""
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    net, _ = build_musicnn()
    exact_parts = parts(copy.deepcopy(net).double())
    rows, missing = [], set()
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (part, (module, shape)) in enumerate(parts(net).items()):
            if only not in part:
                continue
            module, exact = module.eval(), exact_parts[part][0].eval()
            for S in streams:
                x = torch.randn(S, *shape, generator=g)
                want = exact(x.double()).numpy()
                runners, setup = {}, {}
                for engine in engines:
                    t0 = time.perf_counter()
                    run = _runner(engine, module, x, Path(tmp) / f"part{i}-{S}.onnx", threads)
                    if run is None:
                        missing.add(engine)
                        continue
                    out = run(x.numpy())                        # the first call: set-up too
                    setup[engine] = time.perf_counter() - t0
                    runners[engine] = (run, float(np.abs(out.astype(np.float64) - want).max()))
                times = {e: [] for e in runners}
                a = x.numpy()
                for _ in range(ROUNDS):             # blocks in turns: an engine's idle threads
                    for engine, (run, _) in runners.items():     # (spinning) never overlap another's
                        run(a)
                        for _ in range(max(1, calls // ROUNDS)):
                            t0 = time.perf_counter()
                            run(a)
                            times[engine].append(time.perf_counter() - t0)
                for engine, (_, diff) in runners.items():
                    rows.append({"part": part, "streams": S, "engine": engine,
                                 "median_ms": 1e3 * statistics.median(times[engine]),
                                 "setup_s": setup[engine], "max_abs_diff": diff,
                                 "reference_max_abs": float(np.abs(want).max())})
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
