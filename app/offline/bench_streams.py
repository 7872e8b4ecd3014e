"""`bench --streams [--device cpu|cuda]`: S concurrent streams of the demo signal (seeds 0..S-1)
in one engine (app/runtime/streams.py) with the musicnn front end and the five shipped models,
for S = 1, 2, 4, ... until the hop's p95 passes half a hop (125 ms): the hop's time (every
stream's audio, front end and every model's batched step), FLOPs per stream-hop, GFLOP/s against
the machine's matmul peak, resident memory per added stream, and the real-time capacity: the
largest S whose p95 hop is at most 125 ms.
"""
from __future__ import annotations

import statistics
import time

import torch

from app.runtime.memory import rss_mb
from app.runtime.records import percentile
from audio.melspec import HOP_SECONDS

REAL_TIME_MS = 1e3 * HOP_SECONDS / 2          # p95 hop at most half a hop: 125 ms


def streams_bench(device: str = "cpu", hops: int = 24, warm: int = 4, max_streams: int = 1 << 16) -> dict:
    from app.runtime.lineup import default_lineup
    from app.runtime.streams import StreamsEngine
    from audio.frontends import build_frontend
    from audio.sources import DemoSource

    from .bench_attention import matmul_peak

    frontend = build_frontend("musicnn", device=device)
    rows, base = [], rss_mb()
    streams = 1
    while streams <= max_streams:
        engine = StreamsEngine(frontend, default_lineup(frontend, device), capacity=streams)
        for i in range(streams):
            engine.join(DemoSource(seed=i)).source.name = f"demo:{i}"
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
               "rss_mb": rss_mb() - base}
        row["gflops"] = row["flops_per_stream_hop"] * streams / (row["hop_ms_median"] * 1e6)
        rows.append(row)
        print(f"  {streams:6d} streams: hop median {row['hop_ms_median']:8.1f} ms, p95 {row['hop_ms_p95']:8.1f} ms, "
              f"{row['gflops']:6.2f} GFLOP/s, +{row['rss_mb']:.0f} MB", flush=True)
        del engine
        if row["hop_ms_p95"] > REAL_TIME_MS:
            break
        streams *= 2
    ok = [r["streams"] for r in rows if r["hop_ms_p95"] <= REAL_TIME_MS]
    fitting = [r for r in rows if r["streams"] > 1]
    per_stream = (statistics.median((b["rss_mb"] - a["rss_mb"]) / (b["streams"] - a["streams"])
                                    for a, b in zip(rows, rows[1:])) if len(fitting) else float("nan"))
    return {"device": device, "threads": torch.get_num_threads(), "frontend": frontend.description,
            "models": [e.name for e in default_lineup(frontend, device)], "rows": rows,
            "peak_gflops": matmul_peak(2 * 512 ** 3), "mb_per_stream": per_stream,
            "capacity": max(ok) if ok else 0, "hops": hops}


def print_streams(r: dict) -> None:
    print(f"streams in one engine on {r['device']} ({r['threads']} threads), {r['frontend']} + "
          f"{len(r['models'])} models, {r['hops']} timed hops each; matmul peak {r['peak_gflops']:.1f} GFLOP/s; "
          f"resident memory per added stream {r['mb_per_stream']:.1f} MB")
    print(f"real-time capacity: {r['capacity']} streams ({r['device']})")


def streams_why(r: dict) -> str:
    """What bounds the capacity, from the run's own numbers."""
    row = r["rows"][-1]
    share = row["frontend_flops_per_stream_hop"] / row["flops_per_stream_hop"]
    at_peak = REAL_TIME_MS * r["peak_gflops"] * 1e6 / row["frontend_flops_per_stream_hop"]
    return (f"The musicnn front end is {100 * share:.0f} % of each stream-hop's FLOPs "
            f"({row['frontend_flops_per_stream_hop'] / 1e6:.0f} of {row['flops_per_stream_hop'] / 1e6:.0f} M): "
            f"even at the matmul peak, {REAL_TIME_MS:.0f} ms holds the front ends of {at_peak:.0f} streams, "
            f"whatever the models cost.")


def streams_table(r: dict) -> list[str]:
    lines = ["| streams | hop median (ms) | hop p95 (ms) | MFLOPs per stream-hop | GFLOP/s | of matmul peak | resident (MB) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in r["rows"]:
        lines.append(f"| {row['streams']} | {row['hop_ms_median']:.1f} | {row['hop_ms_p95']:.1f} | "
                     f"{row['flops_per_stream_hop'] / 1e6:.1f} | {row['gflops']:.2f} | "
                     f"{100 * row['gflops'] / r['peak_gflops']:.0f} % | {row['rss_mb']:.0f} |")
    return lines
