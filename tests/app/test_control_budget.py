"""Control calls never make a live stream drop a hop: the k-means fits and model builds run on the
engine's control thread, and the requests applied between two hops stay within a time budget.
Oracle: the real-time source's own drop count (a hop is dropped when processing is more than
4 hops behind), on the musicnn front end with models of the paper's size."""
import threading
import time

import pytest

from app.runtime.engine import Engine
from audio.frontends import build_frontend
from audio.sources import DemoSource
from models.transformer import ModelConfig, build_model

pytestmark = pytest.mark.slow
VARIANTS = ("regular", "continual", "nystrom", "continual_nystrom")


def paper_sized(variant, seed=0, layers=1):
    return build_model(ModelConfig(variant=variant, in_dim=50, layers=layers), seed=seed)   # d 192, 16 heads, n 120


def live_engine():
    return Engine(build_frontend("musicnn"), {v: paper_sized(v) for v in VARIANTS})


def every_event(results):
    return [e for r in results for e in r.events]


def test_100_calls_a_second_for_a_minute_drop_no_hop():
    """Every 4 s six fresh untrained 2-block Nyström models are added and all models switched to
    fixed landmarks (the window's "fixed landmarks" box: six k-means fits, about 1.6 s, which on
    the processing thread stalled the stream past the source's 4-hop tolerance), between cheap
    calls (landmark switches, resets); then switched back and removed."""
    engine, source = live_engine(), DemoSource(realtime=True, seconds=62)
    done, calls = threading.Event(), [0]

    def call(i):
        k, j = divmod(i, 400)
        if j < 6:
            engine.add_model(f"fresh {k}.{j}", paper_sized("continual_nystrom", seed=j, layers=2))
        elif j in (10, 200):
            engine.use_fixed_landmarks(j == 10)
        elif j >= 394:
            engine.remove_model(f"fresh {k}.{j - 394}")
        else:
            [lambda: engine.set_landmark_mode("continual_nystrom", "fixed"),
             lambda: engine.set_landmark_mode("continual_nystrom", "continual"),
             lambda: engine.reset_model("continual"),
             lambda: engine.reset_model(None)][j % 4]()

    def controller():
        next_at = time.monotonic()
        while not done.is_set():
            call(calls[0])
            calls[0] += 1
            next_at += 0.01
            time.sleep(max(0.0, next_at - time.monotonic()))

    thread, results = threading.Thread(target=controller, daemon=True), []
    try:
        for r in engine.run(source):
            results.append(r)
            if r.step == 4:                                  # the live k-means needs m = 4 tokens
                thread.start()
    finally:
        done.set()
        thread.join()
    events = every_event(results)
    assert calls[0] >= 5500                                  # 100 calls a second for a minute
    # the heavy work did run: at most 84 fits (14 cycles x 6), >= 60 in a run on a quiet machine
    # here, 32 when other jobs shared its cores (the control thread then lags behind the calls,
    # which is allowed; dropping a hop is not)
    assert sum("fitted by k-means" in e for e in events) >= 12, events[-5:]
    assert not [e for e in events if e.startswith("error")], [e for e in events if e.startswith("error")][:3]
    assert len(results) == 248 and results[-1].dropped_hops == 0


def test_a_burst_of_20k_calls_drops_no_hop_and_is_applied_in_call_order():
    """A live landmark switch rebuilds the model's running sums (about 0.5 ms), so about 100
    requests fit in one hop's budget: the burst is applied over later hops, in call order."""
    engine, source = live_engine(), DemoSource(realtime=True, seconds=20)
    mode = ("fixed", "continual")
    expected = ["reset regular" if i % 3 == 0 else f"continual_nystrom: {mode[i % 2]} landmarks"
                for i in range(20_000)]
    results = []
    for r in engine.run(source):
        results.append(r)
        if r.step == 8:
            threading.Thread(target=lambda: [
                engine.set_landmark_mode("continual_nystrom", mode[i % 2]) if i % 3
                else engine.reset_model("regular") for i in range(20_000)]).start()
    applied = [e.split(" (")[0] for e in every_event(results)]           # without the k-means note
    assert len(applied) >= 2000 and applied == expected[:len(applied)]
    assert max(len(r.events) for r in results) < 1000                    # spread over hops
    assert results[-1].dropped_hops == 0
