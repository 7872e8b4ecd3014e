"""Pluggable front ends in the engine: one front-end computation per hop whatever the number of
models, a model fed at its token spacing (a slot per phase), front-end mismatches refused, and
the trained models shipped in assets/."""
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import tiny_model

from app.runtime.engine import EngineError
from app.runtime.lineup import ASSETS, shipped_checkpoints
from audio.errors import FrontEndMismatchError
from audio.frontends import MusicnnFrontEnd, build_frontend
from audio.sources import DemoSource
from audio.tokens.stream import TokenStream
from app.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from engine_helpers import engine_of

ROOT = Path(__file__).resolve().parents[2]


def small(variant="continual_nystrom", in_dim=50, n=6, **kw):
    return tiny_model(variant, n=n, in_dim=in_dim, **kw)


def test_engine_computes_the_front_end_once_per_hop_for_any_number_of_models():
    fe = build_frontend("musicnn")
    pushes = []
    make_stream = fe.stream

    def counting_stream():
        state = make_stream()
        push = state.push
        state.push = lambda hop: pushes.append(1) or push(hop)
        return state
    fe.stream = counting_stream
    models = {f"m{i}": small(n=6) for i in range(5)}
    engine = engine_of(fe, models, spacing={f"m{i}": 1 + i % 4 for i in range(5)})
    results = list(engine.run([DemoSource(seconds=3)]))
    assert len(results) == 12 and len(pushes) == 12
    assert {n: m.spacing for n, m in results[-1].models.items()} == {f"m{i}": 1 + i % 4 for i in range(5)}
    assert results[-1].mel.shape[1] == 96 and results[-1].frontend_flops > 0


def test_engine_results_equal_a_model_fed_the_front_ends_tokens_at_its_spacing(errors):
    fe = build_frontend("musicnn")
    tokens = torch.cat([i.token for i in TokenStream(DemoSource(seconds=4), fe)])   # (16, 50)
    engine = engine_of(fe, {"cn": small()}, spacing={"cn": 4})
    results = list(engine.run([DemoSource(seconds=4)]))
    phases = [small() for _ in range(4)]          # hop t answered by the phase fed hops t mod 4, t mod 4 + 4, ...
    for model in phases:
        model.reset(1)
    for t, (r, token) in enumerate(zip(results, tokens)):
        p = torch.softmax(phases[t % 4].step(token[None])[0], -1)
        errors("engine probabilities vs a model fed each phase",         # as test_engine.PROB_TOL
               float(np.abs(np.array(r.models["cn"].probabilities) - p.numpy()).max()), 3e-6)


def test_a_model_of_another_front_end_is_refused():
    vggish = build_frontend("vggish", random_vggish=0)
    with pytest.raises(FrontEndMismatchError, match="front end is vggish"):
        engine_of(vggish, {"m": small(in_dim=50)})
    with pytest.raises(FrontEndMismatchError, match="trained on musicnn"):
        engine_of(vggish, {"m": small(in_dim=128)}, frontends={"m": "musicnn"})
    engine = engine_of(vggish, {})
    engine.add_model("m", small(in_dim=50))
    assert any("front end is vggish" in e for e in engine.apply_pending())
    assert "m" not in engine.entries


def test_checkpoints_record_their_front_end_and_refuse_another(tmp_path):
    model = small()
    fe = {"name": "musicnn", "token_dim": 50, "spacing_hops": 4, "weights": "x"}
    save_checkpoint(model, tmp_path / "c.pt", classes=[f"g{i}" for i in range(10)], frontend=fe)
    _, payload = load_checkpoint(tmp_path / "c.pt", frontend="musicnn")
    assert payload["frontend"] == fe
    with pytest.raises(CheckpointError, match="trained on musicnn tokens; run it with --frontend musicnn"):
        load_checkpoint(tmp_path / "c.pt", frontend="vggish")
    old = torch.load(tmp_path / "c.pt", weights_only=True)         # a checkpoint from before
    del old["frontend"]
    torch.save(old, tmp_path / "old.pt")
    _, payload = load_checkpoint(tmp_path / "old.pt")
    assert payload["frontend"]["name"] == "musicnn" and payload["frontend"]["spacing_hops"] == 4


def test_shipped_models_are_trained_musicnn_models_of_every_variant():
    paths = shipped_checkpoints("musicnn")
    assert [p.name for p in paths] == [f"musicnn-{v}.pt" for v in (
        "regular", "continual", "nystrom", "continual_nystrom", "continual_nystrom-fixed")]
    for p in paths:
        assert p.stat().st_size < 2_000_000
        model, payload = load_checkpoint(p, frontend="musicnn")
        assert payload["frontend"]["spacing_hops"] == MusicnnFrontEnd.native_spacing == 4
        split = payload["metadata"]["split"]
        assert not (set(split["train"]) | set(split["val"])) & set(split["test"])
        assert model.cfg.layers == 1 and model.cfg.in_dim == 50
    assert load_checkpoint(ASSETS / "musicnn-continual_nystrom-fixed.pt")[0].cfg.landmark_mode == "fixed"


def test_shipped_models_reach_their_recorded_accuracy_on_the_evaluation_tracks(shared_data):
    """Recomputed, not read back: each shipped model's batch forward on the shared musicnn
    evaluation tokens (290 tracks never used for training) gives the test accuracy its
    checkpoint records, and it is at least 75 %."""
    from audio.tokens.cache import convert_musicnn
    from app.offline.training import score
    tokens = convert_musicnn(shared_data / "gtzan_musicnn_tokens")
    X, labels = torch.as_tensor(tokens.X), torch.as_tensor(tokens.labels)
    test = np.flatnonzero(tokens.split == "test")
    assert len(test) == 290
    for p in shipped_checkpoints("musicnn"):
        model, payload = load_checkpoint(p)
        assert sorted(payload["metadata"]["split"]["test"]) == sorted(tokens.ids[test].tolist())
        acc, _ = score(model, X, labels, tokens.lengths, test)
        assert acc == pytest.approx(payload["metadata"]["metrics"]["test_acc"], abs=1e-6)
        assert acc >= 0.75, p.name


def test_engine_error_for_unknown_spacing():
    with pytest.raises(EngineError, match="spacing"):
        engine_of(build_frontend("musicnn"), {"m": small()}, spacing={"m": 0})
    assert issubclass(EngineError, ValueError)


def test_vggish_flop_formula_equals_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    from audio.vggish import vggish_flops
    from audio.vggish import build_embedder
    embedder = build_embedder(random_seed=0)
    with FlopCounterMode(display=False) as counter:
        embedder(np.zeros((1, 96, 64), np.float32))
    assert counter.get_total_flops() == vggish_flops()
