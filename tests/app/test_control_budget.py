"""The control budget, checked deterministically: whatever the host's speed, between two live hops
no control request starts once ``CONTROL_BUDGET_MS`` are spent on the engine's clock, heavy work
(k-means fits) runs on the engine's control thread while hops go on, requests stay in call order,
and each hop records the control time spent before it (``stages['control']``).

The clock is injected (each reading advances it by a fixed tick), so the number of requests a hop
takes is exact. Whether a real stream keeps up under a control storm depends on the host's spare
CPU: `python main.py bench --control 60` measures that (dropped hops, control ms per hop)."""
import math
import threading

import pytest
import torch

from app.runtime.engine import CONTROL_BUDGET_MS, Engine
from engine_helpers import engine_of
from audio.sources import DemoSource
from audio.vggish import build_embedder
from models.landmarks import fit_fixed_landmarks
from models.transformer import ModelConfig, build_model

TICK_MS = 3.0
PER_HOP = math.floor(CONTROL_BUDGET_MS / TICK_MS)   # requests started before the budget is spent: 6


class Ticks:
    """A clock that advances TICK_MS at every reading."""
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += TICK_MS / 1e3
        return self.t


class LiveDemo:
    """The demo signal marked live (control is applied within budget) but not paced by the wall
    clock, so the test runs as fast as the host allows and never drops a hop."""
    realtime = True

    def __init__(self, seconds):
        self.inner = DemoSource(seconds=seconds)
        self.name, self.stats = self.inner.name, self.inner.stats

    def __iter__(self):
        return iter(self.inner)


def small(variant, seed=0):
    return build_model(ModelConfig(variant=variant, in_dim=128, d_model=32, heads=4, ff_dim=48,
                                   window=8, num_landmarks=2, dropout=0.0), seed=seed)


@pytest.fixture(scope="module")
def embedder():
    return build_embedder(random_seed=0)


def engine_with_ticks(embedder, fitted=True):
    """Two small models on a ticking clock; ``fitted``: the Nyström one has its fixed landmarks
    already (a training-phase k-means), so switching its landmarks is cheap and takes no job."""
    cn = small("continual_nystrom")
    if fitted:
        fit_fixed_landmarks(cn, torch.randn(6, 8, 128, generator=torch.Generator().manual_seed(0)))
        cn.set_landmark_mode("continual")
    return engine_of(embedder, {"continual": small("continual"), "cn": cn}, clock=Ticks())


def switch_calls(engine, count):
    """``count`` cheap requests (landmark switches and resets); the events they must give, in order."""
    mode = ("fixed", "continual")
    for i in range(count):
        engine.set_landmark_mode("cn", mode[i % 2]) if i % 3 else engine.reset_model("continual")
    return ["reset continual" if i % 3 == 0 else f"cn: {mode[i % 2]} landmarks" for i in range(count)]


def test_each_hop_starts_no_request_after_the_budget_and_records_its_control_time(embedder):
    engine = engine_with_ticks(embedder)
    results = []
    for r in engine.run([LiveDemo(seconds=5)]):
        results.append(r)
        if r.step == 2:
            expected = switch_calls(engine, 2 * PER_HOP + 2)
    burst = results[3:6]
    assert [len(x.events) for x in burst] == [PER_HOP, PER_HOP, 2]       # exactly the budget's worth
    assert [e for x in burst for e in x.events] == expected              # in call order
    for x in burst[:2]:  # each request starts inside the budget; the reading after it passes it
        assert CONTROL_BUDGET_MS < x.stages["control"] <= CONTROL_BUDGET_MS + 2 * TICK_MS + 1e-9
    idle = [x.stages["control"] for x in results[6:]]
    assert idle and all(ms <= 2 * TICK_MS + 1e-6 for ms in idle)        # nothing queued: two readings
    assert not any(x.events for x in results[6:])


def test_a_stream_that_is_not_live_applies_every_request_before_the_next_hop(embedder):
    engine = engine_with_ticks(embedder)
    seen = []
    for r in engine.run([DemoSource(seconds=3)]):
        seen.append(r)
        if r.step == 2:
            expected = switch_calls(engine, 10 * PER_HOP)
    assert seen[3].events == expected and seen[3].stages["control"] > 10 * PER_HOP * TICK_MS


def test_a_heavy_fit_runs_on_the_control_thread_and_holds_back_later_requests(embedder, monkeypatch):
    """While a k-means fit is held on the control thread, hops go on without it and the requests
    after it wait; once it is done, it and they are applied in call order."""
    gate, threads = threading.Event(), []
    original = Engine._fit_live

    def held_fit(model, recent):
        threads.append(threading.current_thread().name)
        gate.wait(60)
        return original(model, recent)
    monkeypatch.setattr(Engine, "_fit_live", staticmethod(held_fit))
    engine = engine_with_ticks(embedder, fitted=False)
    results = []
    for r in engine.run([LiveDemo(seconds=4)]):
        results.append(r)
        if r.step == 3:
            engine.set_landmark_mode("cn", "fixed")
            engine.reset_model("continual")
            engine.reset_model(None)
        if r.step == 10:                     # seven hops streamed while the fit was held
            assert r.models["cn"].landmark_mode == "continual"
            gate.set()
    assert threads and all(t.startswith("engine-control") for t in threads), threads
    assert not any(x.events for x in results[4:11])
    events = [e.split(" (")[0] for x in results for e in x.events]
    assert events == ["cn: fixed landmarks", "reset continual", "reset all models"]
    assert results[-1].models["cn"].landmark_mode == "fixed" and results[-1].dropped_hops == 0
