"""`bench --streams [--device cpu|cuda]`: S concurrent streams of the demo signal (seeds 0..S-1)
in one engine (app/runtime/engine.py) with the musicnn front end and the five shipped models (or
those named: ``bench_setup``), for S = 1, 2, 4, ... (or from ``start``) until the hop's p95
passes half a hop (125 ms): the hop's time (every
stream's audio, front end and every model's batched step), FLOPs per stream-hop, GFLOP/s against
the machine's matmul peak, resident memory per added stream (``per_stream_mb``), and the
real-time capacity: the largest S whose p95 hop is at most 125 ms, found to within 1/8 by halving
the last doubling's gap (``next_streams``).

More measurements say where the hop's time goes: ``tensor_bench``, the hop's batched tensor
work alone (the musicnn network's push of 15 or 16 log-mel frames per stream and each model's
step, the probabilities copied back; no audio, log-mel or records); the network's push by which
temporal branches keep accumulators (frontend_modes.py); and ``step_bench``, one stream's model
step per shipped model (on CUDA: the batch's step for one stream, without and with its CUDA
graph).
"""
from __future__ import annotations

import itertools
import statistics
import time

import torch

from app.runtime.memory import release_free_heap, rss_mb
from app.runtime.records import percentile
from audio.melspec import HOP_SECONDS

REAL_TIME_MS = 1e3 * HOP_SECONDS / 2          # p95 hop at most half a hop: 125 ms


def device_peak(device: str) -> float:
    """GFLOP/s of one float32 matrix product: 512^3 on the CPU (attention.matmul_peak),
    8192^3 on CUDA (TF32 off, as the float32 front end runs; a `--precision tf32` run is set against it too)."""
    from .attention import matmul_peak
    if device != "cuda":
        return matmul_peak(2 * 512 ** 3)
    a = 8192
    x, y = torch.randn(a, a, device="cuda"), torch.randn(a, a, device="cuda")
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(x, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * a ** 3 / (statistics.median(times[1:]) * 1e9)


def device_mb() -> float:
    return torch.cuda.memory_allocated() / 2 ** 20 if torch.cuda.is_available() else 0.0


def bench_setup(device: str, models=None, mode: str = "float32"):
    """(musicnn front end, its lineup): the shipped models, or those of them named in ``models``
    (UnknownModelError naming the shipped ones for a name that is not)."""
    from app.runtime.lineup import default_lineup
    from audio.frontends import build_frontend

    frontend = build_frontend("musicnn", device=device, precision=mode)
    return frontend, default_lineup(frontend, device, models=models or None)


def demo_stream(i: int, seconds: float | None = None):
    """The i-th demo stream: the demo signal with seed i, named demo:i."""
    from audio.sources import DemoSource
    source = DemoSource(seed=i, seconds=seconds)
    source.name = f"demo:{i}"
    return source


def steady_after(entries, every_hop: bool = False) -> int:
    """Hops until every model of the lineup steps as it does from then on
    (models/stream/batch.py ``steps_to_steady``, times its spacing; ``every_hop``: each model
    stepped every hop): warm-up and every CUDA graph's capture happen before a hop is timed."""
    from models.stream.batch import steps_to_steady
    return 1 + max((1 if every_hop else e.spacing) * (steps_to_steady(e.model.cfg) - 1) for e in entries)


def streams_row(device: str, streams: int, hops: int, warm: int, threads: int, models=None, mode: str = "float32") -> dict:
    """One row, in a fresh process (``streams_bench``): the engine's hop for ``streams`` demo
    streams, and the resident memory the engine and its streams added to the process."""
    from app.runtime.engine import Engine
    torch.set_num_threads(threads)
    frontend, entries = bench_setup(device, models, mode)
    release_free_heap()
    base = rss_mb()
    engine = Engine(frontend, entries, capacity=streams)
    engine.warm()                                     # as serve readies its engine
    for i in range(streams):
        engine.join(demo_stream(i))
    times, flops, front = [], [], []
    for k in range(warm + hops):
        t0 = time.perf_counter()
        records = engine.hop()
        if device == "cuda":
            torch.cuda.synchronize()
        if k >= warm:
            times.append((time.perf_counter() - t0) * 1e3)
            flops += [r.frontend_flops + sum(m.flops["model"] for m in r.models.values()) for r in records]
            front += [r.frontend_flops for r in records]
    row = {"streams": streams, "hop_ms_median": statistics.median(times), "hop_ms_p95": percentile(times, 0.95),
           "flops_per_stream_hop": statistics.mean(flops), "frontend_flops_per_stream_hop": statistics.mean(front),
           "rss_with_free_heap_mb": rss_mb() - base}
    release_free_heap()
    row["rss_mb"] = rss_mb() - base
    row["gflops"] = row["flops_per_stream_hop"] * streams / (row["hop_ms_median"] * 1e6)
    print(f"  {streams:6d} streams: hop median {row['hop_ms_median']:8.1f} ms, p95 {row['hop_ms_p95']:8.1f} ms, "
          f"{row['gflops']:6.2f} GFLOP/s, +{row['rss_mb']:.0f} MB", flush=True)
    return row


def next_streams(rows: list[dict], max_streams: int, resolution: int = 8, start: int = 1) -> int | None:
    """The next stream count to time, or None when the capacity is known: S doubles from
    ``start`` (halves, while even that is over) until a
    row's p95 passes 125 ms (or S would pass ``max_streams``); then the gap between the largest S
    within 125 ms and the smallest beyond is halved until it is at most 1/``resolution`` of the
    former (at least 1 stream)."""
    ok = [r["streams"] for r in rows if r["hop_ms_p95"] <= REAL_TIME_MS]
    over = [r["streams"] for r in rows if r["hop_ms_p95"] > REAL_TIME_MS]
    if not over:
        after = 2 * max(ok, default=0) or start
        return after if after <= max_streams else None
    hi = min(over)
    lo = max((s for s in ok if s < hi), default=0)
    if lo == 0:                                  # nothing within yet: halve down (from a large ``start``)
        return hi // 2 if hi > 1 else None
    return None if hi - lo <= max(1, lo // resolution) else (lo + hi) // 2


def per_stream_mb(rows: list[dict]) -> float:
    """Resident MB per added stream: the median of the slopes between every two rows (Theil-Sen:
    one row's outlying memory, a heap that grew unlike the others, moves it little) from half the
    largest count up (below the front end's chunk of streams computed together, a hop's
    temporaries still grow with the streams)."""
    top = max(r["streams"] for r in rows)
    pts = [(r["streams"], r["rss_mb"]) for r in rows if 2 * r["streams"] >= top]
    slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in itertools.combinations(pts, 2) if x1 != x0]
    return statistics.median(slopes) if slopes else float("nan")


def streams_bench(device: str = "cpu", hops: int = 24, warm: int | None = None, max_streams: int = 1 << 16,
                  models=None, mode: str = "float32", start: int = 1) -> dict:
    """Rows in the order ``next_streams`` asks for them, each in a fresh process (spawned; one at a
    time), so that one row's memory, heap and warm caches are not the next one's."""
    import multiprocessing

    frontend, entries = bench_setup(device, models, mode)
    warm = steady_after(entries) if warm is None else warm
    rows = []
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        while (streams := next_streams(rows, max_streams, start=start)) is not None:
            rows.append(pool.apply(streams_row, (device, streams, hops, warm, torch.get_num_threads(), models, mode)))
    rows.sort(key=lambda r: r["streams"])
    ok = [r["streams"] for r in rows if r["hop_ms_p95"] <= REAL_TIME_MS]
    return {"device": device, "threads": torch.get_num_threads(), "frontend": frontend.description,
            "models": [e.name for e in entries], "precision": frontend.net.precision, "rows": rows,
            "peak_gflops": device_peak(device), "mb_per_stream": per_stream_mb(rows),
            "mb_per_stream_from": "held after the free heap is given back, the median slope between every two "
                                  "rows from half the largest count up",
            "capacity": max(ok) if ok else 0, "hops": hops, "warm": warm, "fresh_processes": True}


def tensor_bench(device: str = "cpu", hops: int = 12, warm: int | None = None, max_streams: int = 1 << 16,
                 models=None, mode: str = "float32", start: int = 1) -> dict:
    """The hop's batched tensor work alone for S = 1, 2, 4, ... streams until its p95 passes 125 ms
    (or the device's memory runs out): the musicnn network's push of 15 or 16 random log-mel
    frames per stream, each shipped model's step on the taggrams, the probabilities copied back."""
    import numpy as np

    from app.runtime.memory import many_streams_heap
    from audio.musicnn.batch import MusicnnBatch
    from models.stream.batch import StreamBatch

    many_streams_heap()                               # as Engine.warm() sets it

    frontend, entries = bench_setup(device, models, mode)
    warm = steady_after(entries, every_hop=True) if warm is None else warm
    rng = np.random.default_rng(0)
    rows, streams = [], start
    while streams <= max_streams:
        release_free_heap()
        base = device_mb() if device == "cuda" else rss_mb()
        try:
            net = MusicnnBatch(frontend.net, streams)
            batches = [StreamBatch(e.model, streams) for e in entries]
            slots = list(range(streams))
            for s in slots:
                net.reset(s)
                for b in batches:
                    b.join()
            pattern = [[(rng.random((15 + (s + h) % 2, 96), dtype=np.float32) * 4) for s in slots] for h in range(2)]
            times, flops = [], []
            for k in range(warm + hops):
                t0 = time.perf_counter()
                tags = net.push(slots, pattern[k % 2])
                probabilities = [torch.softmax(b.step(slots, tags), dim=-1) for b in batches]
                torch.cat(probabilities, dim=1).cpu()
                if k >= warm:
                    times.append((time.perf_counter() - t0) * 1e3)
                    flops.append(2 * int(net.macs[0]) + sum(b.step_flops(0)["model"] for b in batches))
        except torch.OutOfMemoryError:
            print(f"  {streams:6d} streams: out of device memory", flush=True)
            break
        release_free_heap()
        used = (device_mb() if device == "cuda" else rss_mb()) - base
        row = {"streams": streams, "hop_ms_median": statistics.median(times), "hop_ms_p95": percentile(times, 0.95),
               "flops_per_stream_hop": statistics.mean(flops), "mb_per_stream": used / streams}
        row["gflops"] = row["flops_per_stream_hop"] * streams / (row["hop_ms_median"] * 1e6)
        rows.append(row)
        print(f"  {streams:6d} streams, tensor work alone: hop median {row['hop_ms_median']:8.1f} ms, "
              f"p95 {row['hop_ms_p95']:8.1f} ms, {row['gflops']:8.1f} GFLOP/s, {row['mb_per_stream']:.1f} MB/stream", flush=True)
        del net, batches
        if device == "cuda":
            torch.cuda.empty_cache()
        if row["hop_ms_p95"] > REAL_TIME_MS:
            break
        streams *= 2
    ok = [r["streams"] for r in rows if r["hop_ms_p95"] <= REAL_TIME_MS]
    return {"rows": rows, "capacity": max(ok) if ok else 0, "hops": hops, "warm": warm}


def streams_key(device: str, models=None, mode: str = "float32") -> str:
    """The stored run's name: streams-DEVICE[-MODEL...][-PRECISION] (none for float32)."""
    return "-".join(["streams", device, *(m.replace("/", "-") for m in models or ()), *([mode] if mode != "float32" else [])])


def step_bench(device: str = "cpu", steps: int = 200, models=None) -> list[dict]:
    """One stream's model step per shipped model past warm-up, median microseconds: on the CPU
    the model's own step (fused where it has one); on CUDA a one-stream StreamBatch (the step of
    `classify FILE FILE --cuda` and `serve --device cuda`) without ("eager") and with its CUDA
    graph. The window and single-file `classify --cuda` step the model itself."""
    from models.stream.batch import StreamBatch

    out = []
    for e in bench_setup(device, models)[1]:
        x = torch.rand(1, e.model.cfg.in_dim, device=device)
        row = {"model": e.name}
        paths = {"graph": True, "eager": False} if device == "cuda" else {"step": None}
        for path, graphs in paths.items():
            if graphs is None:
                e.model.reset(1)
                step = lambda: e.model.step(x)                                  # noqa: E731
            else:
                batch = StreamBatch(e.model, 1, graphs=graphs)
                slots = [batch.join()]
                step = lambda: batch.step(slots, x)                             # noqa: E731
            for _ in range(e.model.cfg.window + 2):
                step()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e6)
            row[f"{path}_us"] = statistics.median(times)
        out.append(row)
        print(f"  one stream, {e.name}: " + ", ".join(f"{k[:-3]} {v:.0f} us" for k, v in row.items() if k != "model"), flush=True)
    return out


def print_streams(r: dict) -> None:
    print(f"streams in one engine on {r['device']} ({r['threads']} threads), {r['frontend']} + "
          f"{len(r['models'])} models, {r['hops']} timed hops each; matmul peak {r['peak_gflops']:.1f} GFLOP/s; "
          f"resident memory per added stream {r['mb_per_stream']:.1f} MB")
    if "tensor" in r:
        print(f"tensor work alone: {capacity_text(r['tensor'])} within 125 ms ({r['device']})")
    print(f"real-time capacity: {capacity_text(r)} ({r['device']})")


def capacity_text(r: dict) -> str:
    """'S streams', or 'at least S streams' where the run stopped at its cap within real time."""
    capped = r.get("capped_at") and r["capacity"] == max(row["streams"] for row in r["rows"])
    return f"at least {r['capacity']} streams (the run stopped at {r['capped_at']})" if capped else f"{r['capacity']} streams"


def streams_why(r: dict) -> str:
    """What bounds the capacity, from the run's own numbers."""
    row = r["rows"][-1]
    share = row["frontend_flops_per_stream_hop"] / row["flops_per_stream_hop"]
    at_peak = REAL_TIME_MS * r["peak_gflops"] * 1e6 / row["frontend_flops_per_stream_hop"]
    why = (f"The musicnn front end is {100 * share:.0f} % of each stream-hop's FLOPs "
           f"({row['frontend_flops_per_stream_hop'] / 1e6:.0f} of {row['flops_per_stream_hop'] / 1e6:.0f} M): "
           f"even at the matmul peak, {REAL_TIME_MS:.0f} ms holds the front ends of {at_peak:.0f} streams, "
           f"whatever the models cost.")
    tensor = {t["streams"]: t for t in r.get("tensor", {}).get("rows", [])}
    last_ok = [x for x in r["rows"] if x["hop_ms_p95"] <= REAL_TIME_MS and x["streams"] in tensor]
    if last_ok:
        x = last_ok[-1]
        t = tensor[x["streams"]]["hop_ms_median"]
        why += f" At {x['streams']} streams the hop takes {x['hop_ms_median']:.1f} ms, its tensor work alone {t:.1f} ms"
        why += (f": the other {x['hop_ms_median'] - t:.1f} ms are the rest of the hop, each stream's audio (the demo "
                f"signal's synthesis), log-mel and record." if t < x["hop_ms_median"] else
                " (two separate runs: the rest of the hop, each stream's audio, log-mel and record, is within "
                "their difference in timing noise).")
    return why


def hop_table(rows: list[dict], peak: float, memory: list[tuple[str, str]]) -> list[str]:
    """``memory``: (heading, key) of each memory column the rows have."""
    memory = [(head, key) for head, key in memory if all(key in row for row in rows)]
    lines = ["| streams | hop median (ms) | hop p95 (ms) | MFLOPs per stream-hop | GFLOP/s | of matmul peak | "
             + "".join(f"{head} | " for head, _ in memory),
             "| ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(memory)]
    for row in rows:
        lines.append(f"| {row['streams']} | {row['hop_ms_median']:.1f} | {row['hop_ms_p95']:.1f} | "
                     f"{row['flops_per_stream_hop'] / 1e6:.1f} | {row['gflops']:.1f} | "
                     f"{100 * row['gflops'] / peak:.0f} % | " + "".join(f"{row[key]:.1f} | " for _, key in memory))
    return [line.rstrip() for line in lines]


def streams_table(r: dict) -> list[str]:
    return hop_table(r["rows"], r["peak_gflops"], [("resident (MB)", "rss_mb"),
                                                   ("with free heap (MB)", "rss_with_free_heap_mb")])


def tensor_table(r: dict) -> list[str]:
    return hop_table(r["tensor"]["rows"], r["peak_gflops"], [("MB per stream", "mb_per_stream")])


def step_table(r: dict) -> list[str]:
    paths = [k for k in r["steps"][0] if k.endswith("_us")]
    lines = ["| model | " + " | ".join(f"{p[:-3]} (us)" for p in paths) + " |",
             "| --- | " + " | ".join("---:" for _ in paths) + " |"]
    for row in r["steps"]:
        lines.append(f"| {row['model']} | " + " | ".join(f"{row[p]:.0f}" for p in paths) + " |")
    return lines
