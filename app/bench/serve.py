"""`bench --serve N [--ray K]`: the real `serve` command in its own process (musicnn and the
shipped models), and N WebSocket clients on loopback in this process, each streaming real audio
(the shared GTZAN excerpts, else the demo signal with its own seed) in real time, one 0.25 s hop
per message, for ``seconds`` of audio. With ``--ray K`` the same clients and audio then run
against `serve --ray local --replicas K` (a fresh local Ray, the edge spreading the streams over
the K replicas' own ports), and each record's probabilities are compared with the one server's.
The server takes up to N streams from one address (every client is on 127.0.0.1).

Reported: latency from a hop's last sample sent to its record received (median, p95), hops sent
without a record (dropped), whether every client got its verdict and a close 1000, and the
server's CPU (cores, from /proc, summed over its process tree: with Ray, the replicas and Ray's
own servers; and by process: ``role_of``) and resident memory per stream, the clients' CPU
(this process), and the streams an engine hop took on average (the server's ``/v1/health``
counts: its lanes', or its replicas' summed). Real time: p95 at most 150 ms
and nothing dropped. The clients share the machine with the server (their decoding and sockets
count against it).
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from app.runtime.memory import rss_mb
from app.runtime.records import percentile
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


def process_tree(pid: int) -> list[int]:
    """pid and every process below it (Linux /proc: a local Ray's servers and replicas are
    children of the `serve --ray` process)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def proc_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_usage(pid: int) -> dict[int, tuple[float, float]]:
    """pid -> (CPU seconds, resident MB) of every process of the server's tree."""
    return {p: (proc_cpu_seconds(p), rss_mb(p)) for p in process_tree(pid)}


ROLES = (("app.runtime.kernels", "compiled-kernel builds"), ("audio.musicnn.graph", "compiled-push builds"),
         ("spawn_main", "workers"), ("resource_tracker", "workers"), ("ServeReplica", "replicas"),
         ("ProxyActor", "Ray Serve's proxy"), ("ServeController", "Ray Serve's controller"), ("raylet", "raylet"),
         ("gcs_server", "Ray's GCS"))


def role_of(pid: int, server: int) -> str:
    """What a process of the server's tree is, from its command line (Ray names its workers by
    the actor they hold): the `serve` process itself, a `serve --workers` worker (a spawned
    process), a Ray Serve replica, its proxy, ... or another of Ray's processes (idle workers,
    agents, log monitor)."""
    if pid == server:
        return "the serve process"
    try:
        line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "processes that ended"
    return next((role for key, role in ROLES if key in line), "other Ray processes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_server(audio, clients: int, ray: int | None, batch_delay_ms: float | None = None,
               workers: int = 1) -> tuple[list[dict], dict]:
    """The real `serve` (``ray``: `serve --ray local --replicas K`, the streams spread over them) in its
    own process and the clients here; their results and the server tree's CPU and memory."""
    from app.serve.client import timed_clients         # (websockets: not needed to render the page)
    # each replica may take every client, as through a proxy, whose router is not always even
    command = [sys.executable, str(ROOT / "main.py"), "serve", "--max-streams", str(clients),
               "--max-streams-per-address", str(clients)]          # every client is on 127.0.0.1
    command += ["--ray", "local", "--replicas", str(ray), "--port", str(free_port())] if ray else ["--port", "0"]
    command += ["--batch-delay-ms", f"{batch_delay_ms:g}"] if batch_delay_ms is not None else []
    command += ["--processes", str(workers)] if workers > 1 and not ray else []
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        while line and "# serving" not in line:
            line = server.stderr.readline()
        if not line:
            raise RuntimeError("the server did not start")
        url = re.search(r"(ws://\S+/v1/stream)", line).group(1)
        before, wall0, mine0 = tree_usage(server.pid), time.monotonic(), proc_cpu_seconds(os.getpid())
        busiest, done = {}, threading.Event()
        watch = threading.Thread(target=watch_health, args=(url, busiest, done), daemon=True)
        watch.start()
        results = asyncio.run(timed_clients(url, audio))
        done.set()
        watch.join(timeout=35)
        wall, after = time.monotonic() - wall0, tree_usage(server.pid)
        mine = proc_cpu_seconds(os.getpid()) - mine0
        roles = {p: role_of(p, server.pid) for p in after}
        if ray:
            time.sleep(1.5)                              # each replica's last second reported to /v1/health
        try:
            hops = health(url)
        except (OSError, ValueError):                    # a server that cannot answer: no counts
            hops = {}
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    by_role: dict[str, float] = {}
    for p, (c, _) in after.items():
        by_role[roles[p]] = by_role.get(roles[p], 0.0) + (c - before.get(p, (0.0, 0.0))[0]) / wall
    rss0, rss = sum(m for _, m in before.values()), sum(m for _, m in after.values())
    return results, {"cores": sum(by_role.values()), "rss_mb": rss, "rss0_mb": rss0, "processes": len(after),
                     "cores_by_role": by_role, "client_cores": mine / wall,
                     "engine_hops": hops.get("engine_hops", 0), "stream_hops": hops.get("stream_hops", 0),
                     "streams_split": next((busiest[k] for k in ("streams_by_replica", "streams_by_worker",
                                                                  "streams_by_lane") if k in busiest), [])}


def watch_health(url: str, busiest: dict, done: threading.Event) -> None:
    """Read the server's health every second until ``done``; ``busiest`` keeps the answer with the
    most active streams (how they were split over the lanes, or the replicas)."""
    while not done.wait(1.0):
        try:
            h = health(url)
        except (OSError, ValueError):
            continue
        if h.get("active_streams", 0) > busiest.get("active_streams", -1):
            busiest.clear()
            busiest.update(h)


def health(url: str) -> dict:
    """The server's ``/v1/health`` (``url``: its ws://HOST:PORT/v1/stream)."""
    import json
    import urllib.request
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))        # loopback: no proxy
    with direct.open(url.replace("ws://", "http://").replace("/v1/stream", "/v1/health"), timeout=30) as r:
        return json.loads(r.read())


def serve_bench(clients: int, seconds: float = 20.0, ray: int | None = None,
                batch_delay_ms: float | None = None, workers: int = 1) -> dict:
    """One server (``workers`` > 1: `serve --workers K`); with ``ray`` = K also K Ray Serve
    replicas, each client's probabilities compared with the one server's. ``batch_delay_ms``:
    the server's (default: its own)."""
    from app.serve.protocol import BATCH_DELAY_MS
    audio, what = audio_for(clients, seconds)
    results, usage = run_server(audio, clients, None, batch_delay_ms, workers)
    out = summary(results, usage, clients, seconds, what, len(audio[0]))
    out["batch_delay_ms"] = BATCH_DELAY_MS if batch_delay_ms is None else batch_delay_ms
    out["workers"] = workers
    if ray:
        ray_results, ray_usage = run_server(audio, clients, ray, batch_delay_ms)
        diffs = [abs(a - b) for one, other in zip(results, ray_results)
                 for step in set(one["probabilities"]) & set(other["probabilities"])
                 for pa, pb in zip(one["probabilities"][step], other["probabilities"][step])
                 for a, b in zip(pa, pb)]
        out["ray"] = {**summary(ray_results, ray_usage, clients, seconds, what, len(audio[0])), "replicas": ray,
                      "max_probability_difference": max(diffs) if diffs else float("nan"),
                      "compared_records": sum(len(set(a["probabilities"]) & set(b["probabilities"]))
                                              for a, b in zip(results, ray_results))}
    return out


def summary(results: list[dict], usage: dict, clients: int, seconds: float, what: str, hops: int) -> dict:
    latencies = [x for r in results for x in r["latencies"]]
    sent, got = clients * hops, sum(r["records"] for r in results)
    return {"clients": clients, "seconds": seconds, "audio": what, "hops_sent": sent, "records": got,
            "dropped": sent - got,
            "latency_ms_median": statistics.median(latencies) if latencies else float("nan"),
            "latency_ms_p95": percentile(latencies, 0.95),
            "verdicts": sum(r["verdict"] and r["close"] == 1000 for r in results),
            "server_cores": usage["cores"], "server_cores_per_stream": usage["cores"] / clients,
            "server_mb_per_stream": (usage["rss_mb"] - usage["rss0_mb"]) / clients, "server_rss_mb": usage["rss_mb"],
            "server_processes": usage["processes"], "threads": os.cpu_count(),
            "server_cores_by_role": usage["cores_by_role"], "client_cores": usage["client_cores"],
            "streams_per_engine_hop": usage["stream_hops"] / max(1, usage["engine_hops"]),
            "streams_split": usage["streams_split"]}


def print_serve(r: dict) -> None:
    for label, x in [(f"serve ({plain_label(r)})", r)] + ([(f"serve --ray ({ray_label(r['ray'])})", r["ray"])]
                                                          if "ray" in r else []):
        print(f"{label}: {x['clients']} clients streaming {x['audio']} in real time for {x['seconds']:g} s; "
              f"latency median {x['latency_ms_median']:.1f} ms, p95 {x['latency_ms_p95']:.1f} ms; "
              f"{x['dropped']} of {x['hops_sent']} hops dropped; {x['verdicts']} verdicts with close 1000; "
              f"server {x['server_cores']:.2f} cores ({x['server_cores_per_stream']:.3f} per stream), "
              f"+{x['server_mb_per_stream']:.1f} MB per stream")
        print(f"  {roles_line(x)}")
    if "ray" in r:
        print(f"Ray Serve vs one server: {r['ray']['compared_records']} records compared, largest probability "
              f"difference {r['ray']['max_probability_difference']:.1e}")
    print(f"real time (p95 <= {GOAL_P95_MS:g} ms, nothing dropped): {'yes' if real_time(r) else 'no'}"
          + (f"; with Ray Serve: {'yes' if real_time(r['ray']) else 'no'}" if "ray" in r else ""))


def roles_line(x: dict) -> str:
    """Where the server's cores went, by process, and the clients' own (this process)."""
    roles = sorted(x.get("server_cores_by_role", {}).items(), key=lambda kv: -kv[1])
    return ("server cores by process: " + ", ".join(f"{role} {cores:.2f}" for role, cores in roles)
            + f"; the clients (the bench's process) {x['client_cores']:.2f}; streams per engine hop (a "
              f"lane's or a replica's) {x['streams_per_engine_hop']:.1f}"
            + (f"; streams in each {'replica' if 'replicas' in x else 'worker' if x.get('workers', 1) > 1 else 'lane'} "
               f"at the most "
               f"{'+'.join(map(str, x['streams_split']))}" if x.get("streams_split") else "")) if roles else ""


def real_time(x: dict) -> bool:
    return x["latency_ms_p95"] <= GOAL_P95_MS and x["dropped"] == 0


def plain_label(x: dict) -> str:
    """"one process", or "K worker processes" (`serve --workers K`)."""
    return f"{x['workers']} worker processes" if x.get("workers", 1) > 1 else "one process"


def ray_label(x: dict) -> str:
    """"Ray Serve, K replicas"."""
    return f"Ray Serve, {x['replicas']} replicas"


def serve_table(r: dict) -> list[str]:
    lines = ["| server | clients | latency median (ms) | latency p95 (ms) | dropped hops | verdicts | server cores | "
             "cores per stream | MB per stream |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, x in [(plain_label(r), r)] + ([(ray_label(r["ray"]), r["ray"])] if "ray" in r else []):
        lines.append(f"| {label} | {x['clients']} | {x['latency_ms_median']:.1f} | {x['latency_ms_p95']:.1f} | "
                     f"{x['dropped']} of {x['hops_sent']} | {x['verdicts']} | {x['server_cores']:.2f} | "
                     f"{x['server_cores_per_stream']:.3f} | {x['server_mb_per_stream']:.1f} |")
    return lines
