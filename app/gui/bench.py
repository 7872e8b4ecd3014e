"""`python main.py bench --gui SECONDS`: the real window (offscreen unless a display is set) on the
real-time demo signal with six models, the front end on every hop: with musicnn (default) the five
shipped trained models and an untrained 2-block continual Nyström; with VGGish the four variants,
continual Nyström with fixed landmarks and a 2-block continual Nyström, all untrained. Measures the
window's frame time (each panel's too), the end-to-end delay from a hop's last sample to its drawn
result, the real-time factor and drops, the first hop's time after Start (a fresh engine process)
and how the musicnn push ran; ``--hogs N`` runs N busy-looping processes beside it (a
laptop whose cores are busy). `bench --soak SECONDS` is the same run, long: it samples the resident
memory of the window's process and of the engine process every 10 s and reports it at the start,
after 5 minutes and at the end (an hour-long run must stay flat in both).
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from app.runtime.memory import rss_mb
from app.runtime.records import percentile
from audio.melspec import HOP_MS

RSS_EVERY_S = 10.0
SETTLE_S = 300.0            # memory growth is counted after the first 5 minutes


def start_hogs(n: int) -> list[subprocess.Popen]:
    """``n`` processes that keep a core busy each (what a build or a video call does to a laptop)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_builds_in(folder: str) -> None:
    """End the background builds (a compiled push's, the kernels') whose command line or
    environment names ``folder``: a cold run's builds write into caches it deletes."""
    me = str(os.getpid())
    for proc in os.listdir("/proc"):
        if not proc.isdigit() or proc == me:
            continue
        try:
            with open(f"/proc/{proc}/cmdline", "rb") as f, open(f"/proc/{proc}/environ", "rb") as g:
                named = folder.encode() in f.read() + g.read()
            if named:
                os.kill(int(proc), signal.SIGKILL)
        except OSError:
            continue                                       # gone, or not ours to read


def growth_after(samples: list, wall: float) -> float | None:
    """MB grown from the sample nearest SETTLE_S to the last (None: run too short to say)."""
    if wall <= 2 * SETTLE_S:
        return None
    return samples[-1][1] - min(samples, key=lambda x: abs(x[0] - SETTLE_S))[1]


def quantiles(xs) -> dict:
    xs = list(xs)
    return {"median": statistics.median(xs) if xs else float("nan"), "p95": percentile(xs, 0.95),
            "max": max(xs, default=float("nan")), "frames": len(xs)}


PREPARE_WAIT_S = 120.0      # at most this long for the engine process to be ready before Start
FIRST_HOP_GOAL_S = {True: 3.0, False: 1.5}        # cold caches / warm


def gui(seconds: float, vggish_weights: str | None = None, frontend: str = "musicnn",
        progress=None, hogs: int = 0, cold: bool = False) -> dict:
    """The run's numbers; ``progress(seconds, rss_mb, dropped_hops)`` is called every 10 s with
    the window's and the engine's resident MB summed. ``cold``: the engine process's caches are
    empty folders (XDG_CACHE_HOME, NUMBA_CACHE_DIR), as on a fresh install."""
    saved = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "NUMBA_CACHE_DIR", "NYSTREAM_PUSH_CACHE")}
    empty = tempfile.TemporaryDirectory(prefix="nystream-cold-") if cold else None
    if empty is not None:
        os.environ.update(XDG_CACHE_HOME=empty.name, NUMBA_CACHE_DIR=os.path.join(empty.name, "numba"))
        os.environ.pop("NYSTREAM_PUSH_CACHE", None)
    hog_procs = start_hogs(hogs)
    try:
        return {**_gui(seconds, vggish_weights, frontend, progress, hogs), "cold": cold}
    finally:
        for p in hog_procs:
            p.kill()
            p.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if empty is not None:
            stop_builds_in(empty.name)
            empty.cleanup()


def _gui(seconds, vggish_weights, frontend, progress, hogs) -> dict:
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app.gui.ini import IniSettings
    from app.gui.window import PANELS, MainWindow, Options
    from app.runtime.lineup import ModelSpec
    from models.transformer import ModelConfig

    app = QApplication.instance() or QApplication([])
    settings = IniSettings(os.path.join(tempfile.mkdtemp(), "bench.ini"))
    vggish = frontend == "vggish"
    w = MainWindow(Options(source="demo", variants=["regular", "continual", "nystrom", "continual_nystrom"],
                           frontend=frontend, vggish_weights=vggish_weights,
                           random_vggish=0 if vggish and not vggish_weights else None,
                           autostart=False), settings)
    w.show()
    opened = time.monotonic()
    while w.prepared_s is None and time.monotonic() - opened < PREPARE_WAIT_S:   # the user reads the window
        app.processEvents()
        w.drain()
        time.sleep(0.01)
    prepared_s = time.monotonic() - opened if w.prepared_s is not None else None
    started = time.monotonic()
    w.start()
    engine_pid = w.engine.process.pid
    first_hop = []                                         # seconds from Start to the first hop drawn

    def look_for_the_first_hop():
        if w.history:
            first_hop.append(time.monotonic() - started)
            watcher.stop()
    watcher = QTimer()
    watcher.timeout.connect(look_for_the_first_hop)
    watcher.start(10)
    if vggish:
        w.engine.add_model("continual_nystrom 2-block",
                           ModelSpec(config=ModelConfig(variant="continual_nystrom", layers=2)))
        w.engine.add_model("continual_nystrom fixed", ModelSpec(config=ModelConfig(variant="continual_nystrom")))
        QTimer.singleShot(5000, lambda: w.engine.set_landmark_mode("continual_nystrom fixed", "fixed"))
    else:
        cfg = ModelConfig(variant="continual_nystrom", in_dim=50, window=29, layers=2)
        w.engine.add_model("continual_nystrom 2-block", ModelSpec(config=cfg), spacing=4)
    t0 = time.monotonic()
    rss, engine_rss, worst_p95 = [(0.0, rss_mb())], [(0.0, rss_mb(engine_pid))], [0.0]   # (s, MB)

    def sample():
        rss.append((time.monotonic() - t0, rss_mb()))
        engine_rss.append((rss[-1][0], rss_mb(engine_pid)))
        if rss[-1][0] > 30:                               # after start-up: the last 10 s of hops
            last = list(w.delay_ms)[-int(RSS_EVERY_S * 1000 / HOP_MS):]
            worst_p95[0] = max(worst_p95[0], percentile(last, 0.95))
        if progress is not None:
            progress(rss[-1][0], rss[-1][1] + engine_rss[-1][1],
                     w.history[-1].dropped_hops if len(w.history) else 0)
    sampler = QTimer()
    sampler.timeout.connect(sample)
    sampler.start(int(RSS_EVERY_S * 1000))

    def finish():          # the last sample while both processes run (Qt 6's quit closes the window)
        sampler.stop()
        sample()
        app.quit()
    QTimer.singleShot(int(seconds * 1000), finish)
    handlers = {sig: signal.signal(sig, lambda *_: QTimer.singleShot(0, finish))   # Ctrl+C, SIGTERM:
                for sig in (signal.SIGINT, signal.SIGTERM)}                        # end early, report
    try:
        app.exec()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    wall = time.monotonic() - t0
    history = list(w.history)
    common = {"seconds": wall, "hops": len(history), "hogs": hogs, "cores": os.cpu_count(),
              "prepared_s": prepared_s, "push": w.cost.push, "kernels": w.kernels}
    if not history:                            # nothing to measure: said in one line
        w.close()
        return {**common, "first_hop_s": None, "models": 0}
    steady = history[20:] or history           # after start-up (model adds, landmark fit)
    proc = [r.stages["frontend"] + sum(m.latency_ms for m in r.models.values()) for r in steady]
    result = {
        **common, "models": len(history[-1].models), "panel_ms": {k: quantiles(w.panel_ms[k]) for k in PANELS},
        "frame_ms_median": statistics.median(w.frame_ms), "frame_ms_p95": percentile(w.frame_ms, 0.95),
        "frame_ms_max": max(w.frame_ms), "frame_cpu_ms": quantiles(w.frame_cpu_ms),
        "delay_ms_median": statistics.median(list(w.delay_ms)[20:] or w.delay_ms),
        "delay_ms_p95": percentile(list(w.delay_ms)[20:] or w.delay_ms, 0.95),
        "rtf": statistics.fmean(proc) / HOP_MS,
        "dropped_hops": history[-1].dropped_hops, "frontend": history[-1].frontend,
        "first_hop_s": first_hop[0] if first_hop else None,
        "rss_mb": rss, "engine_rss_mb": engine_rss, "delay_ms_worst_p95": worst_p95[0],
        "rss_growth_after_5min_mb": growth_after(rss, wall),
        "engine_rss_growth_after_5min_mb": growth_after(engine_rss, wall),
    }
    w.close()
    w.deleteLater()
    app.processEvents()
    return result
