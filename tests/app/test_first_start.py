"""A first Start with empty caches (app/runtime/kernels.py): the engine serves from its first hop
on the forms that need no compiling (the torch step, the torch pseudo-inverse), its compiled
kernels come from another process through numba's cache, and its streams move to them at a hop
boundary; every record equals, within float32 rounding, a run whose kernels were there from the
start. A cache that cannot be used leaves the torch step serving, with a one-line reason."""
import shutil

import numpy as np
import torch
from tiny import tiny_model

from engine_helpers import engine_of
from audio.sources import DemoSource
from audio.vggish import build_embedder
from models.fused.numba_cache import cache_root
from app.runtime.kernels import Kernels, build, marker

SWITCH = 14          # the hop after which the kernels arrive: past every model's warm-up (n = 8)
# Two float32 paths of the same model (the torch step, the compiled step), each within
# 6 EPS32 (1 + S) sqrt(n) of float64 per block (tests/error_model.py; S = 0.02 here, n = 8:
# 2.1e-6), two blocks at most: 4.2e-6 in the logits; a probability moves by at most half its
# logits' largest change, and each record is rounded to 6 decimals (5e-7 each):
# 2 * 4.2e-6 / 2 + 2 * 5e-7 = 5.2e-6.
PROB_TOL = 6e-6


def models():
    return {"continual": tiny_model("continual", n=8),
            "continual_nystrom": tiny_model("continual_nystrom", n=8),
            "continual_nystrom 2-block": tiny_model("continual_nystrom", n=8, layers=2),
            "nystrom": tiny_model("nystrom", n=8)}


def compiled_now(engine) -> dict[str, bool]:
    """Per model: whether its batch steps in the compiled form (backend; the recomputing
    model's pseudo-inverse)."""
    out = {}
    for name, batch in engine.shards[0].batches.items():
        out[name] = (batch.backend is not None if batch.continual
                     else all(b.attn.compiled_pinv for b in batch.model.blocks))
    return out


def test_a_cold_start_serves_at_once_and_moves_to_the_compiled_kernels_at_a_hop_boundary(tmp_path, monkeypatch, errors):
    embedder = build_embedder(random_seed=0)
    want = list(engine_of(embedder, models(), kernels=None).run([DemoSource(seconds=6)], warm=True))
    kernels = Kernels(numba_cache=tmp_path)
    # its build is another process (tested below): here the kernels arrive when the test says
    monkeypatch.setattr(kernels, "_start_build", lambda: setattr(kernels, "status", "building"))
    cold = engine_of(embedder, models(), kernels=kernels)
    got, forms = [], []
    for r in cold.run([DemoSource(seconds=6)], warm=True):
        got.append(r)
        forms.append(compiled_now(cold))
        if r.step == SWITCH:
            assert kernels.status == "building" and not kernels.ready()
            kernels._load()                                   # loaded in a thread, between two hops
            assert kernels.wait(600) == "compiled"
    assert [r.step for r in got] == [r.step for r in want] == list(range(24))
    assert all(not any(f.values()) for f in forms[:SWITCH + 1])      # the torch forms until then
    assert all(all(f.values()) for f in forms[SWITCH + 1:])          # the compiled ones from the next hop
    worst = 0.0
    for a, b in zip(got, want):
        for name, m in a.models.items():
            worst = max(worst, float(np.abs(np.subtract(m.probabilities, b.models[name].probabilities)).max()))
            assert m.flops == b.models[name].flops and m.landmark_update == b.models[name].landmark_update
    errors("a cold start's records vs a run compiled from the start", worst, PROB_TOL)


def test_the_build_process_fills_the_cache_and_a_later_engine_loads_from_it(tmp_path):
    """The build process (python -m app.runtime.kernels) over a copy of this process's cache
    without its marker (so it loads rather than compiles: seconds, not a minute), then a second
    Kernels finds the marker and loads at once, without a build."""
    if not marker(cache_root()).exists():
        build()                                              # (`make test` prepares it first)
    shutil.copytree(cache_root(), tmp_path / "nystream", ignore=shutil.ignore_patterns("kernels-*"))
    kernels = Kernels(numba_cache=tmp_path)
    kernels.request()
    assert kernels.status == "building" and kernels.build is not None and not kernels.ready()
    assert kernels.wait(600) == "compiled" and kernels.ready()
    assert marker(tmp_path / "nystream").exists() and kernels.words() == "compiled (numba)"
    again = Kernels(numba_cache=tmp_path)
    again.request()
    assert again.build is None and again.status == "compiled" and again.ready()


def test_a_cache_that_cannot_be_used_leaves_the_torch_step_serving(tmp_path):
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    kernels = Kernels(numba_cache=blocked)
    engine = engine_of(build_embedder(random_seed=0), {"continual": tiny_model("continual", n=8)}, kernels=kernels)
    records = list(engine.run([DemoSource(seconds=3)], warm=True))
    assert len(records) == 12 and not compiled_now(engine)["continual"]
    assert kernels.status.startswith("eager: the compiled kernels could not be built (") and "\n" not in kernels.status
    assert not kernels.ready() and kernels.words() == kernels.status
    p = torch.tensor(records[-1].models["continual"].probabilities)
    assert torch.isfinite(p).all() and abs(p.sum().item() - 1) < 1e-5
