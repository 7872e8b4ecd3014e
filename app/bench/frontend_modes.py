"""`bench --streams`, the front end's table: the batched musicnn network's push
(audio/musicnn/batch.py) in each way of keeping its temporal branches (accumulators in every
branch, in the K = 128 one only, in none), for two stream counts (CPU: 8 and 16; CUDA: 1,024 and
4,096, either side of its switch). Per way: the push's median time (15 or 16 random log-mel frames
per stream), MFLOPs per stream-hop (its own count, which the tests hold to torch's FLOP counter),
and its state per stream. On the CPU the three take turns hop by hop in one process, so that the
host's load falls on all three alike; on CUDA they run one after another (their state together
would not fit at 4,096 streams)."""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

MODES = {"every branch": True, "K = 128 only": (True, False, False), "none": False}
SIZES = {"cpu": (8, 16), "cuda": (1024, 4096)}


def frontend_modes_bench(device: str = "cpu", sizes: tuple[int, ...] | None = None, hops: int = 25,
                         warm: int = 10, mode: str = "float32") -> list[dict]:
    from audio.frontends import build_frontend

    net = build_frontend("musicnn", device=device, precision=mode).net
    rows = []
    for streams in sizes or SIZES[device]:
        rng = np.random.default_rng(0)
        frames = [[rng.random((15 + (s + h) % 2, 96), dtype=np.float32) * 4 for s in range(streams)] for h in range(2)]
        for names in [list(MODES)] if device == "cpu" else [[m] for m in MODES]:   # taking turns / one at a time
            try:
                rows += time_modes(net, names, streams, frames, hops, warm)
            except torch.OutOfMemoryError:                   # CUDA: the state of thousands of streams
                print(f"  {streams:6d} streams, front end with accumulators in {names[0]}: out of memory", flush=True)
                rows += [{"streams": streams, "mode": m, "out_of_memory": True,
                          "default": is_default(m, device, net.precision)} for m in names]
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def is_default(mode: str, device: str, precision: str = "float32") -> bool:
    """Whether ``mode`` is what MusicnnBatch keeps by default on ``device`` (for any number of streams)."""
    from audio.musicnn.batch import default_accumulate, per_branch
    return per_branch(MODES[mode]) == default_accumulate(device, precision)


def time_modes(net, names: list[str], streams: int, frames: list, hops: int, warm: int) -> list[dict]:
    """The ways ``names``, taking turns hop by hop on the same frames (frames[k % 2])."""
    from audio.musicnn.batch import MusicnnBatch

    slots = list(range(streams))
    batches = {m: MusicnnBatch(net, streams, accumulate=MODES[m]) for m in names}
    times: dict = {m: [] for m in names}
    macs: dict = {m: [] for m in names}
    for b in batches.values():
        for s in slots:
            b.reset(s)
    for k in range(warm + hops):
        for m in names[k % len(names):] + names[:k % len(names)]:
            t0 = time.perf_counter()
            batches[m].push(slots, frames[k % 2])
            if batches[m].device.type == "cuda":
                torch.cuda.synchronize()
            if k >= warm:
                times[m].append((time.perf_counter() - t0) * 1e3)
                macs[m].append(float(batches[m].macs[slots].mean()))
    rows = []
    for m, b in batches.items():
        state = sum(t.numel() * t.element_size() for t in b.state.values()) / b.capacity
        rows.append({"streams": streams, "mode": m, "accumulate": list(b.accumulate),
                     "default": is_default(m, b.device.type, net.precision),
                     "push_ms_median": statistics.median(times[m]),
                     "mflops_per_stream_hop": 2 * statistics.mean(macs[m]) / 1e6,
                     "state_mb_per_stream": state / 1e6})
        print(f"  {streams:6d} streams, front end with accumulators in {m}: push median "
              f"{rows[-1]['push_ms_median']:7.1f} ms, {rows[-1]['mflops_per_stream_hop']:5.0f} MFLOPs "
              f"per stream-hop, state {rows[-1]['state_mb_per_stream']:.1f} MB per stream", flush=True)
    return rows


def modes_table(rows: list[dict], device: str, precision: str = "float32") -> list[str]:
    """The stored rows, each marked (default) where it is the code's default now."""
    out = ["| streams | temporal accumulators | push median (ms) | MFLOPs per stream-hop | state per stream (MB) |",
           "| ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        mode = r["mode"] + (" (default)" if is_default(r["mode"], device, precision) else "")
        out.append(f"| {r['streams']} | {mode} | out of memory | | |" if r.get("out_of_memory") else
                   f"| {r['streams']} | {mode} | {r['push_ms_median']:.1f} | {r['mflops_per_stream_hop']:.0f} | "
                   f"{r['state_mb_per_stream']:.1f} |")
    return out
