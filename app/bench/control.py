"""`python main.py bench --control SECONDS`: a control storm on a live stream, measured.

The real-time demo signal through the musicnn front end into the four variants at the paper's size
(d 192, 16 heads, n 120), while another thread makes 100 control calls a second: every 4 s six fresh
untrained 2-block continual Nyström models are added and every model is switched to fixed
landmarks (six live k-means fits on the engine's control thread), between landmark switches and
resets; then they are switched back and removed. Whether the stream keeps up depends on this
machine's spare CPU, so it is a measurement (dropped hops, control time per hop), not a test.
"""
from __future__ import annotations

import statistics
import threading
import time

from app.runtime.engine import CONTROL_BUDGET_MS, Engine
from app.runtime.lineup import Entry
from app.runtime.records import percentile
from audio.frontends import build_frontend
from audio.sources import DemoSource
from models.transformer import ModelConfig, build_model
from models.variants import VARIANTS

CALLS_PER_S = 100
CYCLE = 400                 # calls per add / fit / remove cycle (4 s)


def paper_sized(variant: str, in_dim: int, seed: int = 0, layers: int = 1):
    """An untrained model of the paper's size (d 192, 16 heads, n 120)."""
    return build_model(ModelConfig(variant=variant, in_dim=in_dim, layers=layers), seed=seed)


def storm_call(engine: Engine, i: int) -> None:
    """The i-th call of the storm."""
    k, j = divmod(i, CYCLE)
    if j < 6:
        engine.add_model(f"fresh {k}.{j}", paper_sized("continual_nystrom", engine.frontend.token_dim,
                                                       seed=j, layers=2))
    elif j in (10, 200):
        engine.use_fixed_landmarks(j == 10)
    elif j >= CYCLE - 6:
        engine.remove_model(f"fresh {k}.{j - (CYCLE - 6)}")
    else:
        [lambda: engine.set_landmark_mode("continual_nystrom", "fixed"),
         lambda: engine.set_landmark_mode("continual_nystrom", "continual"),
         lambda: engine.reset_model("continual"),
         lambda: engine.reset_model(None)][j % 4]()


def control_storm(seconds: float, frontend: str = "musicnn") -> dict:
    """Run the storm for ``seconds`` of real-time audio; the numbers of the run."""
    fe = build_frontend(frontend, random_vggish=0 if frontend == "vggish" else None)
    engine = Engine(fe, [Entry(v, paper_sized(v, fe.token_dim), False, 1, None) for v in VARIANTS])
    source = DemoSource(realtime=True, seconds=seconds)
    done, calls = threading.Event(), [0]

    def controller():
        next_at = time.monotonic()
        while not done.is_set():
            storm_call(engine, calls[0])
            calls[0] += 1
            next_at += 1 / CALLS_PER_S
            time.sleep(max(0.0, next_at - time.monotonic()))

    thread, results = threading.Thread(target=controller, daemon=True), []
    try:
        for r in engine.run([source], warm=True):
            results.append(r)
            if r.step == 4:                                  # the live k-means needs m = 4 tokens
                thread.start()
    finally:
        done.set()
        if thread.is_alive():
            thread.join()
    events = [e for r in results for e in r.events]
    control = [r.stages["control"] for r in results]
    return {"seconds": seconds, "hops": len(results), "calls": calls[0],
            "dropped_hops": results[-1].dropped_hops if results else 0,
            "fits": sum("fitted by k-means" in e for e in events),
            "events": len(events), "errors": [e for e in events if e.startswith("error")],
            "control_ms_median": statistics.median(control) if control else 0.0,
            "control_ms_p95": percentile(control, 0.95), "control_ms_max": max(control, default=0.0),
            "frontend": fe.name}


def print_control(r: dict) -> None:
    print(f"control storm, {r['calls']} calls in {r['seconds']:.0f} s of real-time {r['frontend']} "
          f"audio ({CALLS_PER_S} a second; six live k-means fits every {CYCLE // CALLS_PER_S} s):")
    print(f"  {r['hops']} hops, dropped hops {r['dropped_hops']} (goal 0); {r['fits']} k-means fits; "
          f"{r['events']} control events, {len(r['errors'])} errors")
    print(f"  control time before a hop: median {r['control_ms_median']:.2f} ms, "
          f"p95 {r['control_ms_p95']:.2f} ms, max {r['control_ms_max']:.2f} ms "
          f"(budget {CONTROL_BUDGET_MS:.0f} ms plus the request in progress)")
    for e in r["errors"][:3]:
        print(f"  {e}")
