"""`bench --serve N`: the real `serve` command in its own process (musicnn and the shipped
models), and N WebSocket clients on loopback in this process, each streaming real audio (the
shared GTZAN excerpts, else the demo signal with its own seed) in real time, one 0.25 s hop per
message, for ``seconds`` of audio.

Reported: latency from a hop's last sample sent to its record received (median, p95), hops sent
without a record (dropped), whether every client got its verdict and a close 1000, and the
server's CPU (cores, from /proc) and resident memory per stream. Real time: p95 at most 150 ms
and nothing dropped. The clients share the machine with the server (their decoding and sockets
count against it).
"""
from __future__ import annotations

import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from app.runtime.memory import rss_mb
from app.runtime.records import percentile
from app.serve.client import timed_clients
from audio.melspec import HOP_SECONDS

GOAL_P95_MS = 150.0
ROOT = Path(__file__).resolve().parents[2]


def audio_for(clients: int, seconds: float) -> tuple[list[list[np.ndarray]], str]:
    """Each client's 16 kHz hops: real excerpts (../shared/data) when present, else the demo signal."""
    from audio.sources import DemoSource, FileSource
    hops = int(seconds / HOP_SECONDS)
    shared = ROOT.parent / "shared" / "data" / "gtzan_excerpts"
    files = sorted(shared.rglob("*.wav")) if shared.is_dir() else []
    out = []
    for i in range(clients):
        source = FileSource(files[i % len(files)], loop=True) if files else DemoSource(seed=i)
        it = iter(source)
        out.append([next(it) for _ in range(hops)])
        source.close()
    return out, ("GTZAN excerpts (../shared/data)" if files else "the demo signal")


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_bench(clients: int, seconds: float = 20.0) -> dict:
    audio, what = audio_for(clients, seconds)
    server = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "serve", "--port", "0",
                               "--max-streams", str(clients)], stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        while line and "# serving" not in line:
            line = server.stderr.readline()
        if not line:
            raise RuntimeError("the server did not start")
        url = re.search(r"(ws://\S+/v1/stream)", line).group(1)
        rss0, cpu0, wall0 = rss_mb(server.pid), proc_cpu_seconds(server.pid), time.monotonic()
        results = asyncio.run(timed_clients(url, audio))
        wall, cpu, rss = time.monotonic() - wall0, proc_cpu_seconds(server.pid) - cpu0, rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    latencies = [x for r in results for x in r["latencies"]]
    sent = clients * len(audio[0])
    return {"clients": clients, "seconds": seconds, "audio": what, "hops_sent": sent,
            "records": sum(r["records"] for r in results), "dropped": sent - sum(r["records"] for r in results),
            "latency_ms_median": statistics.median(latencies) if latencies else float("nan"),
            "latency_ms_p95": percentile(latencies, 0.95),
            "verdicts": sum(r["verdict"] and r["close"] == 1000 for r in results),
            "server_cores": cpu / wall, "server_cores_per_stream": cpu / wall / clients,
            "server_mb_per_stream": (rss - rss0) / clients, "server_rss_mb": rss,
            "threads": os.cpu_count()}


def print_serve(r: dict) -> None:
    ok = r["latency_ms_p95"] <= GOAL_P95_MS and r["dropped"] == 0
    print(f"serve: {r['clients']} clients streaming {r['audio']} in real time for {r['seconds']:g} s; "
          f"latency median {r['latency_ms_median']:.1f} ms, p95 {r['latency_ms_p95']:.1f} ms; "
          f"{r['dropped']} of {r['hops_sent']} hops dropped; {r['verdicts']} verdicts with close 1000; "
          f"server {r['server_cores']:.2f} cores ({r['server_cores_per_stream']:.3f} per stream), "
          f"+{r['server_mb_per_stream']:.1f} MB per stream")
    print(f"real time (p95 <= {GOAL_P95_MS:g} ms, nothing dropped): {'yes' if ok else 'no'}")


def serve_table(r: dict) -> list[str]:
    return ["| clients | latency median (ms) | latency p95 (ms) | dropped hops | verdicts | server cores | "
            "cores per stream | MB per stream |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| {r['clients']} | {r['latency_ms_median']:.1f} | {r['latency_ms_p95']:.1f} | {r['dropped']} of "
            f"{r['hops_sent']} | {r['verdicts']} | {r['server_cores']:.2f} | {r['server_cores_per_stream']:.3f} | "
            f"{r['server_mb_per_stream']:.1f} |"]
