"""The compiled CPU backend (models/fused/) against the step it compiles (models/stream/): the
same model stepped by the torch step only, and both float32 paths within the error model of the
float64 model at every step; the events and FLOPs they report are equal. Streams cover warm-up,
continual landmark updates, stability refreshes and rescales, live landmark-mode switches and
resets, several streams at once.
"""
import copy

import pytest
import torch

from models.fused import available
from models.landmarks import fit_fixed_landmarks
from models.stream.model import ModelStep
from app.bench.sda import streaming_sda
from models.transformer import ModelConfig, build_model
from error_model import attention_tol, model_scores, relative_tol

pytestmark = pytest.mark.skipif(not available(), reason="numba not installed")
STAGES_PER_BLOCK = 6    # float32 stages chained in a block: embedding or input, q/k/v projection,
                        # scores, softmax sums, output projection, feed-forward (tests/error_model.py)
NYSTROM_STAGES = 6      # Nystrom attention alone: three softmax factors, the pseudo-inverse, two products


def pair(variant, layers, n=24, m=4, fixed=False, seed=0):
    """A reference model and its fused copy (same weights)."""
    cfg = ModelConfig(variant=variant, in_dim=16, d_model=32, heads=4, ff_dim=48, window=n,
                      num_landmarks=m, layers=layers, dropout=0.0)
    ref = build_model(cfg, seed=seed, fused=False).eval()
    if fixed:
        g = torch.Generator().manual_seed(seed)
        fit_fixed_landmarks(ref, torch.randn(6, n, 16, generator=g), max_tokens=500)
        ref.set_landmark_mode(cfg.home_landmark_mode)
    return ref, copy.deepcopy(ref).use_fused(True)


def scale_of(x):
    return max(1.0, x.abs().max().item())


class Worst:
    """The worst ratio of error to tolerance over a stream, per path against float64."""

    def __init__(self, *paths):
        self.at = {p: (0.0, 1.0, -1) for p in paths}       # (error, tolerance, step)

    def add(self, path, got, exact, tol, t):
        err = (got.double() - exact).abs().max().item() / scale_of(exact)
        if err / tol > self.at[path][0] / self.at[path][1]:
            self.at[path] = (err, tol, t)

    def check(self, errors, name):
        for path, (err, tol, t) in self.at.items():
            errors(f"{name} ({path} vs float64)", err, tol, where=f"at step {t}")


def window_of(tokens, t, n, since=0):
    """(1, n_t, D) the window of a stream (T, 1, D) ending at token t, after a reset at ``since``."""
    return tokens[max(since, t + 1 - n):t + 1].transpose(0, 1)


def torch_steps(model) -> list:
    """The positions at which ``model`` took the torch step (a spy on ModelStep.forward)."""
    seen = []
    original = ModelStep.forward

    def spy(self, token, t, *state, known=None):
        if self.embed is model.embed:
            seen.append(int(t[0]))
        return original(self, token, t, *state, known=known)
    return seen, spy


@pytest.mark.parametrize("variant,layers", [("continual", 1), ("continual_nystrom", 1),
                                            ("continual", 2), ("continual_nystrom", 2)])
def test_the_backend_equals_the_torch_step_through_switches_and_resets(variant, layers, seed, errors, monkeypatch):
    """Two streams; tokens swinging up to 24x (scores up to ~500), so rows are rescaled and
    refreshed on the compiled path too. Both float32 paths against the float64 model (error
    model: tests/error_model.py, relative to the output scale, with the step's largest score
    and the window's n terms); equal events and FLOPs; the torch step taken exactly where the
    backend takes none (warm-up, a landmark replaced, a switch's next step, a stream's first)."""
    n = 24
    ref, fus = pair(variant, layers, n=n, fixed=variant == "continual_nystrom", seed=seed)
    exact = copy.deepcopy(ref).double()
    g = torch.Generator().manual_seed(seed + 1)
    swing = 12 * (1 + torch.sin(torch.arange(5.0 * n) / 7)).view(-1, 1, 1)
    tokens = torch.randn(5 * n, 2, 16, generator=g) * swing
    for model in (ref, fus, exact):
        model.reset(2)
    taken, spy = torch_steps(fus)
    monkeypatch.setattr(ModelStep, "forward", spy)
    worst, events, since, compiled = Worst("torch", "fused"), set(), 0, 0
    for t, x in enumerate(tokens):
        if variant == "continual_nystrom" and t in (40, 70):          # live switches
            mode = "fixed" if t == 40 else "continual"
            for model in (ref, fus, exact):
                model.set_landmark_mode(mode)
        if t == 90:                                                    # a reset mid-stream
            for model in (ref, fus, exact):
                model.reset(2)
            since = t
        before = len(taken)
        a, b, c = ref.step(x), fus.step(x), exact.step(x.double())
        compiled += len(taken) == before
        score = model_scores(exact, window_of(tokens, t, n, since).double(), exact.window_start())
        tol = relative_tol(score, n, STAGES_PER_BLOCK * layers)
        worst.add("torch", a, c, tol, t)
        worst.add("fused", b, c, tol, t)
        assert torch.equal(ref.events, fus.events), t
        assert ref.step_flops() == fus.step_flops(), t
        events |= {tuple(e) for e in ref.events.tolist()}
    worst.check(errors, f"backend, {variant} {layers}-block")
    assert compiled >= 2 * n                                            # the backend took most steps
    if variant == "continual_nystrom":
        assert any(e[0] for e in events) and any(e[1] for e in events), events      # rebuilt, replaced
    if seed == 0 and (variant == "continual_nystrom" or layers == 2):            # running sums
        assert any(e[2] for e in events) and any(e[3] for e in events), events      # refreshed, rescaled


@pytest.mark.parametrize("mode", ["continual", "fixed"])
@pytest.mark.parametrize("layers", [1, 2])
def test_steady_steps_are_compiled(mode, layers, monkeypatch):
    """The torch step is entered only where the backend takes none: 1 block, continual
    landmarks: the 24 warm-up steps and one per completed segment of 6 after them; fixed: the
    first; 2 blocks: the window's first n tokens too."""
    ref, fus = pair("continual_nystrom", layers, n=24, fixed=True)
    fus.set_landmark_mode(mode)
    fus.reset(1)
    taken, spy = torch_steps(fus)
    monkeypatch.setattr(ModelStep, "forward", spy)
    for x in torch.randn(120, 1, 16):
        fus.step(x)
    warm = list(range(24)) if mode == "continual" or layers == 2 else [0]
    replaced = [t for t in range(24, 120) if (t + 1) % 6 == 0] if mode == "continual" else []
    assert taken == warm + replaced


def test_the_sda_kernel_equals_the_torch_step_on_huge_scores(seed, errors):
    """Single-output continual Nyström with scores swinging to ~500: rescales and refreshes
    happen at the same steps on both paths, and both are within the error model's tolerance of
    the float64 window reference with the stream's landmarks at every step (relative to the
    output scale, with the window's largest score: one rounding of a score of 500 is already a
    3e-5 relative change of its exp). Checked against the reference at every step with an
    event on either path and the two after it (where a mishandled rescale shows), and every
    third step besides."""
    from test_sda_stability import reference, rising_falling_stream
    T, B, d, n, m = 3000, 2, 16, 32, 4
    q, k, v = rising_falling_stream(T, B, d, peak=500.0, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    fixed = (torch.randn(m, d, generator=g) * 2, torch.randn(m, d, generator=g) * 2)
    for mode in ("continual", "fixed"):
        a, b = (streaming_sda("continual_nystrom", n, num_landmarks=m, landmark_mode=mode,
                              fixed_landmarks=fixed, fused=f) for f in (False, True))
        a.reset(B)
        b.reset(B)
        worst, refreshed, rescaled, last_event = Worst("torch", "fused"), 0, 0, -10
        for t in range(T):
            qt, kt, vt = q[:, t].float(), k[:, t].float(), v[:, t].float()
            oa, ob = a.step(qt, kt, vt), b.step(qt, kt, vt)
            assert torch.isfinite(ob).all()
            assert torch.equal(a.events, b.events), t
            if bool(b.events[0, 1:].any()):
                last_event = t
            if t % 3 and t - last_event > 2:
                continue
            lo = max(0, t + 1 - n)
            score = (q[:, lo:t + 1] @ k[:, lo:t + 1].transpose(1, 2)).abs().max().item() / d ** 0.5
            tol = relative_tol(score, n, NYSTROM_STAGES)
            want = reference(a, "continual_nystrom", q, k, v, t, n, False)
            worst.add("torch", oa, want, tol, t)
            if not all(torch.equal(x, y) for x, y in zip(a.landmarks(), b.landmarks())):
                want = reference(b, "continual_nystrom", q, k, v, t, n, False)   # (the same landmarks: the same)
            worst.add("fused", ob, want, tol, t)
            refreshed += int(b.events[0, 2])
            rescaled += int(b.events[0, 3])
        assert refreshed > 0 and rescaled > 0, (refreshed, rescaled)
        worst.check(errors, f"continual nystrom kernel/{mode}, scores to 500")


@pytest.mark.parametrize("variant,mode", [("continual", None), ("continual_nystrom", "continual"),
                                          ("continual_nystrom", "fixed")])
def test_no_two_tensors_of_a_streams_state_share_memory(variant, mode):
    """The compiled kernels update the state in place, so the torch step must never hand back
    one tensor as two fields (a denominator that is also its peak was rescaled twice by the
    kernel): through warm-up, landmark replacements and steady steps, both step kinds."""
    T, B, d, n, m = 3 * 16, 2, 8, 16, 4
    g = torch.Generator().manual_seed(3)
    fixed = (torch.randn(m, d, generator=g), torch.randn(m, d, generator=g)) if mode == "fixed" else None
    for retro in (False, True):
        s = streaming_sda(variant, n, retroactive=retro, num_landmarks=m if "nystrom" in variant else None,
                          landmark_mode=mode, fixed_landmarks=fixed, fused=True)
        s.reset(B)
        for t in range(T):
            s.step(*(torch.randn(B, d, generator=g) for _ in range(3)))
            storages = [x.untyped_storage().data_ptr() for x in s.state]
            assert len(set(storages)) == len(storages), (retro, t)


def test_models_built_or_loaded_from_python_take_the_backend_unless_asked_not_to(tmp_path):
    from app.checkpoint import load_checkpoint, save_checkpoint
    cfg = ModelConfig(variant="continual_nystrom", in_dim=16, d_model=32, heads=4, ff_dim=48, window=8,
                      num_landmarks=2)
    for model in (build_model(cfg, seed=0), build_model(cfg)):
        model.eval().reset(1)
        assert model.fused and model.streams.backend is not None
    reference = build_model(cfg, seed=0, fused=False).eval()
    reference.reset(1)
    assert not reference.fused and reference.streams.backend is None
    save_checkpoint(reference, tmp_path / "m.pt", classes=[str(i) for i in range(10)])
    loaded = load_checkpoint(tmp_path / "m.pt")[0]
    torch_path = load_checkpoint(tmp_path / "m.pt", fused=False)[0]
    assert loaded.fused and not torch_path.fused
    loaded.use_fused(False).reset(1)                  # the torch step alone, one call away
    assert loaded.streams.backend is None


def test_the_backend_only_where_it_applies():
    """A float64 model takes the torch step, still correct."""
    ref, fus = pair("continual_nystrom", 1)
    fus.double()
    ref.double()
    fus.reset(2)
    ref.reset(2)
    assert fus.streams.backend is None
    for x in torch.randn(40, 2, 16, dtype=torch.float64):
        assert torch.allclose(ref.step(x), fus.step(x), atol=1e-10)


def aligned_means(x, t, m, n):
    """x: (B, n_t, d) the window after t tokens -> (B, m', d) means over the stream-aligned
    segments (models/landmarks.aligned_segments), from the definition."""
    from models.landmarks import aligned_segments
    return torch.stack([x[:, a:b].mean(dim=1) for a, b in aligned_segments(t, n, m)], dim=1)


@pytest.mark.parametrize("fused", [False, True])
def test_two_block_continual_landmarks_follow_the_updated_window(fused, seed, errors):
    """Block 2's continual landmarks are the stream-aligned segment means of block 2's queries and
    keys over block 1's *current* (retroactively updated) outputs, so the stream equals the batch
    forward at every step. Oracle, in float64: block 1 recomputed by its batch forward on the
    window (with the stream's block-1 landmarks), then the aligned segment means taken here."""
    n, m = 12, 3
    ref, fus = pair("continual_nystrom", 2, n=n, m=m, seed=seed)
    model = fus if fused else ref
    exact = copy.deepcopy(ref).double()
    model.reset(1)
    tokens = torch.randn(4 * n + 5, 1, 16, generator=torch.Generator().manual_seed(seed + 3))
    worst = Worst("landmarks", "logits")
    for t in range(tokens.shape[0]):
        logits = model.step(tokens[t])
        window, start = window_of(tokens, t, n).double(), model.window_start()
        marks = [tuple(x.double() for x in pair_) for pair_ in model.landmarks()]
        h = exact.pos(exact.embed(window), start)
        h1 = exact.blocks[0](h, marks[0])                               # (1, n_t, D)
        q, k, _ = exact.blocks[1].attn.qkv(h1)                          # folded (H, n_t, dh)
        want = (aligned_means(q, t + 1, m, n), aligned_means(k, t + 1, m, n))
        tol = relative_tol(model_scores(exact, window, start), n, STAGES_PER_BLOCK * 2)
        if not fused or t < n:             # (the backend keeps no block-2 landmarks: the torch step's)
            for got, exp in zip(model.landmarks()[1], want):
                worst.add("landmarks", got, exp, tol, t)
        worst.add("logits", logits, exact(window, start=start, landmarks=[marks[0], want]), tol, t)
    worst.check(errors, f"2-block block-2 landmarks, {'fused' if fused else 'torch'}")


@pytest.mark.parametrize("m", [1, 4, 6])
def test_compiled_pinv_equals_reference(m, errors):
    """models/fused/pinv.py against the torch oracle, from flat to peaked landmark kernels. Error
    model, relative to the inverse's largest entry: 6 Newton-Schulz iterations of m x m products
    (about 18 m roundings) amplified by the kernel's condition number kappa: EPS * 18 m * kappa.
    The tolerances allow kappa up to ~1e4 in float64 (1e-9) and ~10 in float32 (1e-6); the worst
    observed over these 12 kernels is 4.5e-14 and 4.5e-8."""
    from models.fused.pinv import landmark_pinv as compiled
    from models.sda.reference import landmark_pinv
    g = torch.Generator().manual_seed(m)
    for scale in (0.05, 1.0, 5.0, 30.0):
        q, k = (torch.randn(8, m, 12, generator=g) * scale for _ in range(2))
        z32, z64 = compiled(q, k, 6)
        ref = landmark_pinv(q.double(), k.double(), 6)
        assert z64.dtype == torch.float64 and z32.dtype == torch.float32
        top = ref.abs().max().item()
        errors("compiled pinv, float64", (z64 - ref).abs().max().item() / top, 1e-9, where=f"scale {scale}")
        errors("compiled pinv, float32", (z32.double() - ref).abs().max().item() / top, 1e-6, where=f"scale {scale}")


def test_the_folded_window_equals_projected_keys_and_values():
    """Block 2's products through its window x with the projections folded in
    (models/stream/window.py) against the explicitly projected keys and values, in float64:
    softmax rows of the scores and the mixes agree."""
    from models.mha import MultiheadAttention
    from models.stream.window import WindowStep
    g = torch.Generator().manual_seed(0)
    S, n, D, H, r = 2, 7, 16, 4, 3
    dh = D // H
    attn = MultiheadAttention(D, H, n, "continual").double()
    step = WindowStep(attn, n, "continual")
    x = torch.randn(S, n, D, generator=g, dtype=torch.float64)
    q, k, v = (t.view(S, n, H, dh).transpose(1, 2) for t in attn.in_proj(x).chunk(3, dim=-1))   # (S, H, n, dh)
    qs = torch.randn(S, H, r, dh, generator=g, dtype=torch.float64)
    valid = torch.ones(S, n, dtype=torch.bool)
    p = torch.softmax(qs @ k.transpose(-1, -2), dim=-1)
    assert torch.allclose(torch.softmax(step.scores(qs, x, valid), dim=-1), p, atol=1e-12)
    assert torch.allclose(step.mix(p, x), p @ v, atol=1e-12)


@pytest.mark.parametrize("layers", [1, 2])
def test_recomputing_nystrom_with_the_compiled_pinv_equals_reference(layers, seed, errors):
    """`nystrom` recomputes the window every step; after use_fused its pseudo-inverse is the
    compiled one (in inference), and its logits, like the torch reference's, are within the error
    model's tolerance of the float64 model."""
    n = 24
    ref, fused = pair("nystrom", layers, n=n, seed=seed)
    exact = copy.deepcopy(ref).double()
    assert all(b.attn.compiled_pinv for b in fused.blocks)
    assert not any(b.attn.compiled_pinv for b in ref.blocks + exact.blocks)
    for model in (ref, fused, exact):
        model.reset(1)
    g = torch.Generator().manual_seed(seed + 3)
    tokens = torch.randn(40, 1, 16, generator=g)
    worst = Worst("torch", "fused")
    for t, x in enumerate(tokens):
        a, b, c = ref.step(x), fused.step(x), exact.step(x.double())
        tol = relative_tol(model_scores(exact, window_of(tokens, t, n).double(), exact.window_start()),
                           n, STAGES_PER_BLOCK * layers)
        worst.add("torch", a, c, tol, t)
        worst.add("fused", b, c, tol, t)
    worst.check(errors, f"recomputed nystrom {layers}-block, compiled pinv")


@pytest.mark.parametrize("mode", ["segment", "fixed"])
def test_recomputing_nystrom_kernel_with_the_compiled_pinv_equals_reference(mode, monkeypatch, seed, errors):
    """The `nystrom` SDA stream with ``fused``: every step's pseudo-inverse is the compiled one
    (counted on the real function) and its outputs, like the torch kernel's, are within the error
    model's tolerance of the float64 window reference, warm-up included."""
    import models.fused.pinv as compiled
    from reference import window_reference
    calls = []
    real = compiled.landmark_pinv
    monkeypatch.setattr(compiled, "landmark_pinv", lambda *a: calls.append(1) or real(*a))
    n, m, T = 20, 4, 50
    g = torch.Generator().manual_seed(seed + 4)
    fixed = (torch.randn(m, 8, generator=g, dtype=torch.float64), torch.randn(m, 8, generator=g, dtype=torch.float64))
    kernels = [streaming_sda("nystrom", n, num_landmarks=m, landmark_mode=mode,
                             fixed_landmarks=tuple(x.float() for x in fixed) if mode == "fixed" else None,
                             fused=f) for f in (False, True)]
    for s in kernels:
        s.reset(3)
    q, k, v = (torch.randn(3, T, 8, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    tol = attention_tol(q, k, v, n, NYSTROM_STAGES)
    worst = Worst("torch", "fused")
    for t in range(T):
        a, b = (s.step(q[:, t].float(), k[:, t].float(), v[:, t].float()) for s in kernels)
        want = window_reference("nystrom", mode, q, k, v, t, n, m, fixed)[:, -1]
        worst.add("torch", a, want, tol / scale_of(want), t)        # Worst divides by the scale
        worst.add("fused", b, want, tol / scale_of(want), t)
    worst.check(errors, f"recomputed nystrom kernel/{mode}, compiled pinv")
    assert len(calls) == T


@pytest.mark.parametrize("variant,layers", [("continual", 1), ("continual_nystrom", 1), ("continual_nystrom", 2)])
def test_the_backend_reads_the_live_weights_from_one_packed_buffer(variant, layers, tmp_path, seed, errors):
    """The backend's weights are the model's parameters (one buffer, shared memory): an
    in-place change after reset (an optimizer step, load_state_dict) reaches the next fused
    step, a second reset keeps the buffer, and the state dict round-trips unchanged."""
    n = 24
    ref, fus = pair(variant, layers, n=n, fixed=variant == "continual_nystrom", seed=seed)
    exact = copy.deepcopy(ref).double()
    for model in (ref, fus, exact):
        model.reset(1)
    buf = fus.streams.backend.packed.buffer
    g = torch.Generator().manual_seed(seed + 3)
    tokens = torch.randn(60, 1, 16, generator=g)
    worst = Worst("torch", "fused")
    for t, x in enumerate(tokens):
        if t == 30:                                   # new weights mid-stream, no reset
            new = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                   for k, v in ref.state_dict().items()}
            for model in (ref, fus, exact):
                model.load_state_dict(new)
        a, b, c = ref.step(x), fus.step(x), exact.step(x.double())
        tol = relative_tol(model_scores(exact, window_of(tokens, t, n).double(), exact.window_start()),
                           n, STAGES_PER_BLOCK * layers)
        worst.add("torch", a, c, tol, t)
        worst.add("fused", b, c, tol, t)
    worst.check(errors, f"fused model, {variant} {layers}-block, new weights mid-stream")
    fus.reset(1)
    assert fus.streams.backend.packed.buffer.ctypes.data == buf.ctypes.data   # not packed twice
    assert fus.embed.weight.data_ptr() == buf.ctypes.data
    torch.save(fus.state_dict(), tmp_path / "w.pt")
    back = build_model(fus.cfg)
    back.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    for k, v in fus.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)
