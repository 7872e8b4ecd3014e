"""The streaming engine without Qt: live control, equality with a fresh stream, dropped hops."""
import json
import time

import pytest
import torch
from tiny import tiny_model

from engine_helpers import engine_of
from audio.gtzan import GENRES
from audio.sources import DemoSource
from audio.tokens.stream import TokenStream
from audio.vggish import build_embedder


def small(variant, n=8, **kw):
    return tiny_model(variant, n=n, **kw)


# The engine rounds probabilities to 6 decimals (+-5e-7) and steps the fused path; the oracle is the
# torch path of the same float32 model. Each path's logits are within 6 EPS32 (1 + S) sqrt(n) of
# float64 (tests/error_model.py; the largest score S of these tiny models on these tokens is 0.02,
# so 2.1e-6 at n = 8), and a probability moves by at most half its logits' largest change:
# 5e-7 + 2 * 2.1e-6 / 2 = 2.6e-6.
PROB_TOL = 3e-6


def close(errors, got, want, name="engine probabilities vs the same model stepped alone"):
    errors(name, (torch.as_tensor(got, dtype=torch.float64) - want.double()).abs().max().item(), PROB_TOL)


def reference_logits(model, tokens):
    """Logits of a fresh model stepping ``tokens`` (T, 128): the oracle for the engine."""
    model.reset(1)
    return [torch.softmax(model.step(t[None])[0], -1) for t in tokens]


def test_results_match_a_fresh_stream_and_carry_every_field(errors):
    embedder = build_embedder(random_seed=0)
    tokens = torch.cat([item.token for item in TokenStream(DemoSource(seconds=3), embedder)])
    engine = engine_of(embedder, {"continual": small("continual"), "continual_nystrom": small("continual_nystrom")})
    results = list(engine.run([DemoSource(seconds=3)]))
    assert [r.step for r in results] == list(range(12))
    for name in ("continual", "continual_nystrom"):
        ref = reference_logits(small(name), tokens)
        for r, p in zip(results, ref):
            close(errors, r.models[name].probabilities, p)
    r = results[-1]
    assert r.mel.shape == (25, 64)
    assert {n: m.landmark_mode for n, m in r.models.items()} == {"continual": None, "continual_nystrom": "continual"}
    assert set(r.stages) == {"frontend", "mel", "network", "control"} and r.input_rate == 16000
    assert r.models["continual"].classes == list(GENRES) and r.models["continual"].top[0] in GENRES
    assert r.models["continual_nystrom"].flops["sda"] > 0 and r.models["continual"].state_bytes > 0
    assert r.done_time >= r.ready_time > 0 and r.dropped_hops == 0
    d = r.to_dict()
    assert "mel" not in d and d["models"]["continual"]["top"][0] == r.models["continual"].top[0]
    json.loads(r.to_json())


def test_models_are_added_removed_reset_and_switched_mid_stream(errors):
    embedder = build_embedder(random_seed=0)
    tokens = torch.cat([item.token for item in TokenStream(DemoSource(seconds=6), embedder)])
    engine = engine_of(embedder, {"regular": small("regular")})
    seen = []
    for r in engine.run([DemoSource(seconds=6)]):
        seen.append(r)
        if r.step == 3:
            engine.add_model("continual", small("continual"))
            engine.add_model("cn", small("continual_nystrom"))
        if r.step == 9:
            engine.remove_model("regular")
            engine.set_landmark_mode("cn", "fixed")        # untrained: fitted on the stream
        if r.step == 12:
            engine.reset_model("continual")
        if r.step == 15:
            engine.set_landmark_mode("regular", "fixed")    # gone: reported, not raised
    assert set(seen[3].models) == {"regular"}
    assert set(seen[4].models) == {"regular", "continual", "cn"}
    assert "regular" not in seen[10].models
    assert any("fitted by k-means" in e for e in seen[10].events)
    assert seen[10].models["cn"].landmark_mode == "fixed" and seen[9].models["cn"].landmark_mode == "continual"
    assert any("no model named 'regular'" in e for e in seen[16].events)
    # a model added at hop 4 equals a fresh model streaming from hop 4; reset restarts it at hop 13
    ref = reference_logits(small("continual"), tokens[4:13])
    for r, p in zip(seen[4:13], ref):
        close(errors, r.models["continual"].probabilities, p)
    ref = reference_logits(small("continual"), tokens[13:])
    for r, p in zip(seen[13:], ref):
        close(errors, r.models["continual"].probabilities, p)
    # after the live switch the stream equals the batch forward with the fitted fixed landmarks
    cn = engine.entries["cn"].model
    window = tokens[len(tokens) - 8:][None]
    start = (len(tokens) - 4 - 8) % cn.cfg.period              # cn's stream began at hop 4
    close(errors, seen[-1].models["cn"].probabilities, torch.softmax(cn(window, start=start)[0], -1),
          "engine probabilities vs the batch forward")
    fixed_flops = {r.models["cn"].flops["sda"] for r in seen[14:]}
    assert max(fixed_flops) < max(r.models["cn"].flops["sda"] for r in seen[4:10])   # no landmark updates


@pytest.mark.slow
def test_a_slow_consumer_makes_the_source_drop_whole_hops():
    engine = engine_of(build_embedder(random_seed=0), {"continual": small("continual")})
    source = DemoSource(realtime=True, seconds=6)
    steps = []
    for r in engine.run([source]):
        steps.append(r)
        if r.step == 1:
            time.sleep(2.5)                 # 10 hops behind: more than the 4 hops of slack
    assert steps[-1].dropped_hops == source.stats.dropped > 0
    assert len(steps) + source.stats.dropped == 24          # every hop is either used or dropped


def test_pause_holds_the_position_of_a_realtime_source():
    source = DemoSource(realtime=True, seconds=2)
    it = iter(source)
    next(it)
    source.paused.set()
    time.sleep(0.8)
    source.paused.clear()
    rest = list(it)
    assert len(rest) == 7 and source.stats.dropped == 0
