"""`python main.py bench --gui SECONDS`: the real window (offscreen unless a display is set) on the
real-time demo signal with six models, the front end on every hop: with musicnn (default) the five
shipped trained models and an untrained 2-block continual Nyström; with VGGish the four variants,
continual Nyström with fixed landmarks and a 2-block continual Nyström, all untrained. Measures the GUI thread's frame time, the
end-to-end delay from a hop's last sample to its drawn result, the real-time factor and drops.
`bench --soak SECONDS` is the same run, long: it samples the process's resident memory every 10 s
and reports it at the start, after 5 minutes and at the end (an hour-long run must stay flat).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time


from app.runtime.records import percentile
from audio.melspec import HOP_MS

RSS_EVERY_S = 10.0
SETTLE_S = 300.0            # memory growth is counted after the first 5 minutes


def rss_mb() -> float:
    """Resident memory of this process now (MB; Linux /proc, else the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def gui(seconds: float, vggish_weights: str | None = None, frontend: str = "musicnn",
        progress=None) -> dict:
    """The run's numbers; ``progress(seconds, rss_mb, dropped_hops)`` is called every 10 s."""
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from app.gui.window import MainWindow, Options
    from models.transformer import ModelConfig, build_model

    app = QApplication.instance() or QApplication([])
    settings = QSettings(os.path.join(tempfile.mkdtemp(), "bench.ini"), QSettings.IniFormat)
    vggish = frontend == "vggish"
    w = MainWindow(Options(source="demo", variants=["regular", "continual", "nystrom", "continual_nystrom"],
                           frontend=frontend, vggish_weights=vggish_weights,
                           random_vggish=0 if vggish and not vggish_weights else None,
                           autostart=False), settings)
    w.show()
    w.start()
    if vggish:
        w.engine.add_model("continual_nystrom 2-block",
                           build_model(ModelConfig(variant="continual_nystrom", layers=2), seed=0))
        fixed = build_model(ModelConfig(variant="continual_nystrom"), seed=0)
        w.engine.add_model("continual_nystrom fixed", fixed)
        QTimer.singleShot(5000, lambda: w.engine.set_landmark_mode("continual_nystrom fixed", "fixed"))
    else:
        cfg = ModelConfig(variant="continual_nystrom", in_dim=50, window=29, layers=2)
        w.engine.add_model("continual_nystrom 2-block", build_model(cfg, seed=0), spacing=4)
    QTimer.singleShot(int(seconds * 1000), app.quit)
    t0 = time.monotonic()
    rss, worst_p95 = [(0.0, rss_mb())], [0.0]           # (seconds, MB); delay p95 of each sample

    def sample():
        rss.append((time.monotonic() - t0, rss_mb()))
        if rss[-1][0] > 30:                               # after start-up: the last 10 s of hops
            last = list(w.delay_ms)[-int(RSS_EVERY_S * 1000 / HOP_MS):]
            worst_p95[0] = max(worst_p95[0], percentile(last, 0.95))
        if progress is not None:
            progress(*rss[-1], w.history[-1].dropped_hops if len(w.history) else 0)
    sampler = QTimer()
    sampler.timeout.connect(sample)
    sampler.start(int(RSS_EVERY_S * 1000))
    app.exec()
    sampler.stop()
    sample()
    wall = time.monotonic() - t0
    history = list(w.history)
    steady = history[20:] or history           # after start-up (model adds, landmark fit)
    proc = [r.stages["frontend"] + sum(m.latency_ms for m in r.models.values()) for r in steady]
    result = {
        "seconds": wall, "hops": len(history), "models": len(history[-1].models) if history else 0,
        "frame_ms_median": statistics.median(w.frame_ms), "frame_ms_p95": percentile(w.frame_ms, 0.95),
        "frame_ms_max": max(w.frame_ms),
        "delay_ms_median": statistics.median(list(w.delay_ms)[20:] or w.delay_ms),
        "delay_ms_p95": percentile(list(w.delay_ms)[20:] or w.delay_ms, 0.95),
        "rtf": statistics.fmean(proc) / HOP_MS,
        "dropped_hops": history[-1].dropped_hops if history else 0,
        "frontend": history[-1].frontend if history else "",
        "rss_mb": rss, "delay_ms_worst_p95": worst_p95[0],
        "rss_growth_after_5min_mb": (rss[-1][1] - min(rss, key=lambda x: abs(x[0] - SETTLE_S))[1]
                                     if wall > 2 * SETTLE_S else None),
    }
    w.close()
    w.deleteLater()
    app.processEvents()
    return result
