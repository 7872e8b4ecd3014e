"""`python main.py bench --scale DIR`: extraction throughput in one process and on Ray.

The same GTZAN-named files are extracted (musicnn front end) in one process, then in a local Ray
instance with 1 and with 2 Ray Data workers; each run's token file must equal the first one bit for
bit. Reports tracks per minute, the speed-up over one process, Ray's start-up time and each
worker's peak resident memory. Numbers of this machine, one run each.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from app.offline.extract import extract_gtzan
from app.offline.ray.extract import FrontEndSpec, RayJob


def worker_peak_mb(stop: threading.Event, fragment: str = "TrackTokens") -> list[float]:
    """Poll /proc until ``stop``: the peak resident MB of each process titled with ``fragment``."""
    peaks: dict[int, float] = {}
    while not stop.wait(0.2):
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and fragment in (proc / "cmdline").read_text():
                    for line in (proc / "status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            peaks[int(proc.name)] = int(line.split()[1]) / 1024
            except OSError:
                pass
    return list(peaks.values())


def scale(folder: str | Path, frontend: str = "musicnn") -> dict:
    spec = FrontEndSpec(frontend, random_vggish=0 if frontend == "vggish" else None)
    fe = spec.build()
    work = Path(tempfile.mkdtemp(prefix="nystream-scale-"))
    quiet = (lambda s: None)
    try:
        t0 = time.monotonic()
        one = extract_gtzan(folder, work / "one.npz", fe, log=quiet)
        rows = [{"run": "one process", "workers": 0, "seconds": time.monotonic() - t0}]
        tracks = len(one.labels)
        from app.offline.ray.cluster import ray_session
        t0 = time.monotonic()
        with ray_session(num_cpus=os.cpu_count()):
            startup = time.monotonic() - t0
            for workers in (1, 2):
                stop, peaks = threading.Event(), []
                poller = threading.Thread(target=lambda: peaks.extend(worker_peak_mb(stop)), daemon=True)
                poller.start()
                t0 = time.monotonic()
                extract_gtzan(folder, work / f"ray{workers}.npz", fe, log=quiet, ray=RayJob(spec, workers))
                seconds = time.monotonic() - t0
                stop.set()
                poller.join()
                same = (work / f"ray{workers}.npz").read_bytes() == (work / "one.npz").read_bytes()
                rows.append({"run": f"Ray, {workers} worker{'s' * (workers > 1)}", "workers": workers,
                             "seconds": seconds, "identical": same,
                             "worker_peak_mb": max(peaks) if peaks else None})
        for r in rows:
            r["tracks_per_min"] = 60 * tracks / r["seconds"]
            r["speedup"] = rows[0]["seconds"] / r["seconds"]
        return {"tracks": tracks, "frontend": fe.description, "ray_startup_s": startup,
                "cpus": os.cpu_count(), "rows": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def scale_table(r: dict) -> list[str]:
    """The runs of ``scale`` as Markdown table lines (printed, and on the benchmark page)."""
    lines = ["| run | seconds | tracks/min | vs one process | identical tokens | worker peak RSS (MB) |",
             "| --- | ---: | ---: | ---: | --- | ---: |"]
    for row in r["rows"]:
        peak = row.get("worker_peak_mb")
        lines.append(f"| {row['run']} | {row['seconds']:.1f} | {row['tracks_per_min']:.1f} | {row['speedup']:.2f}x | "
                     f"{'yes' if row.get('identical', True) else 'NO'} | {'' if peak is None else f'{peak:.0f}'} |")
    return lines


def print_scale(r: dict) -> None:
    print(f"extract: {r['tracks']} tracks, {r['frontend']}, {r['cpus']} CPUs; "
          f"local Ray start-up {r['ray_startup_s']:.1f} s (not in the times below)")
    print("\n".join(scale_table(r)))
