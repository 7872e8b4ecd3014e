"""Multi-head attention against torch's module, and the model's step (the torch reference path;
tests/models/test_fused.py holds the fused one to it) against its batch forward."""
import functools

import pytest
from tiny import tiny_config
import torch
from torch import nn

from models.landmarks import fit_fixed_landmarks
from models.mha import MultiheadAttention
from models import transformer
from error_model import model_scores, relative_tol

build_model = functools.partial(transformer.build_model, fused=False)
VARIANTS = ["regular", "continual", "nystrom", "continual_nystrom"]


@pytest.mark.parametrize("variant", ["regular", "continual"])
def test_mha_from_torch_equals_torch_module_on_the_window(variant):
    torch.manual_seed(0)
    d, h, n, B = 48, 6, 10, 3
    ref = nn.MultiheadAttention(d, h, batch_first=True).eval()
    ours = MultiheadAttention.from_torch(ref, n, variant)
    x = torch.randn(B, n, d)
    full, _ = ref(x, x, x, need_weights=False)
    torch.testing.assert_close(ours(x), full, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["continual", "fixed"])
def test_retroactive_nystrom_out_projection_folded_into_landmark_rows(mode):
    """A 2-block continual Nyström step leaves block 0's outputs factored, P (Z num/den), and
    projects them as P (Z num/den W_o^T) (models/stream/model.py _window_out): equal in float64
    to projecting the unfolded product."""
    from models.stream.model import ModelStep
    torch.manual_seed(0)
    model = build_model(small_config(variant="continual_nystrom", layers=2)).double().eval()
    if mode == "fixed":
        fit_fixed_landmarks(model, torch.randn(4, 12, 16, dtype=torch.float64))
    step = ModelStep(model, mode)
    S, H, n, m, dh = 2, 4, 12, 3, 8
    p = torch.softmax(torch.randn(S, H, n, m, dtype=torch.float64), dim=-1)
    zw = torch.randn(S, H, m, dh, dtype=torch.float64)
    unfolded = (p @ zw).transpose(1, 2).reshape(S, n, H * dh)
    attn = model.blocks[0].attn
    want = torch.nn.functional.linear(unfolded, attn.out_proj.weight, attn.out_proj.bias)
    torch.testing.assert_close(step._window_out((p, zw)), want, atol=1e-12, rtol=0)


small_config = tiny_config


def assert_step_equals_forward(model, x, switch=None, errors=None):
    """Every float32 step against the float64 batch forward of the same weights on its window
    (with the landmarks the step used), relative to the output scale: the error model of
    tests/error_model.py with the window's largest score, n terms, 6 stages per block."""
    import copy
    exact = copy.deepcopy(model).double()
    B, T, _ = x.shape
    model.reset(B)
    worst = (0.0, 1.0, -1)
    for t in range(T):
        if switch and t in switch:
            model.set_landmark_mode(switch[t])
            exact.set_landmark_mode(switch[t])
        out = model.step(x[:, t])
        lo = max(0, t + 1 - model.cfg.window)
        window, start = x[:, lo:t + 1].double(), model.window_start()
        marks = model.landmarks()
        marks = [None if p is None else tuple(m.double() for m in p) for p in marks] if marks else None
        ref = exact(window, start=start, landmarks=marks)
        err = (out.double() - ref).abs().max().item() / max(1.0, ref.abs().max().item())
        score = model_scores(exact, window, start, marks)
        tol = relative_tol(score, model.cfg.window, 6 * model.cfg.layers)
        if err / tol > worst[0] / worst[1]:
            worst = (err, tol, t)
    name = f"model step vs float64 forward, {model.cfg.variant} {model.cfg.layers}-block"
    if errors is not None:
        errors(name, worst[0], worst[1], where=f"at step {worst[2]}")
    else:
        assert worst[0] <= worst[1], (name, worst)


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_model_step_equals_forward_on_the_window(variant, layers, pos, seed, errors):
    torch.manual_seed(seed + 1)
    model = build_model(small_config(variant=variant, layers=layers, pos_encoding=pos)).eval()
    assert_step_equals_forward(model, torch.randn(2, 40, 16), errors=errors)


def test_positional_period_2n_minus_1(seed, errors):
    torch.manual_seed(seed + 2)
    cfg = small_config(variant="continual", layers=2, pos_period=23)
    model = build_model(cfg).eval()
    assert_step_equals_forward(model, torch.randn(1, 60, 16), errors=errors)


def test_batch_forward_with_random_start_uses_recycled_positions():
    torch.manual_seed(3)
    model = build_model(small_config(variant="continual")).eval()
    x = torch.randn(4, 12, 16)
    start = torch.tensor([0, 5, 11, 12])
    out = model(x, start=start)
    for i in range(4):
        torch.testing.assert_close(out[i:i + 1], model(x[i:i + 1], start=int(start[i]) % 12))
    torch.testing.assert_close(out[3:4], model(x[3:4], start=0))   # 12 mod 12 == 0


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("variant", ["nystrom", "continual_nystrom"])
def test_fixed_landmarks_fit_and_live_switch(variant, layers, seed, errors):
    torch.manual_seed(seed + 4)
    model = build_model(small_config(variant=variant, layers=layers)).eval()
    train = torch.randn(40, 12, 16)
    fit_fixed_landmarks(model, train, seed=0)
    assert model.landmark_mode == "fixed"            # model state ...
    assert model.cfg.landmark_mode is None           # ... its identity (config) is unchanged
    for block in model.blocks:
        assert bool(block.attn.has_fixed)
        assert block.attn.fixed_q_land.shape == (4, 3, 8)
    other = "continual" if variant == "continual_nystrom" else "segment"
    assert_step_equals_forward(model, torch.randn(2, 45, 16), switch={15: other, 30: "fixed"}, errors=errors)


def test_fixed_landmarks_are_kmeans_centres_and_seeded():
    from models.landmarks import collect_qk
    from sklearn.cluster import KMeans
    torch.manual_seed(5)
    model = build_model(small_config(variant="continual_nystrom")).eval()
    train = torch.randn(30, 12, 16)
    q, _ = collect_qk(model, train, 0)
    fit_fixed_landmarks(model, train, seed=7)
    first = model.blocks[0].attn.fixed_q_land.clone()
    km = KMeans(n_clusters=3, n_init=4, random_state=7).fit(q[0].double().numpy())
    got = first[0].double().numpy()
    # the same centres (as a set)
    dist = ((got[:, None, :] - km.cluster_centers_[None]) ** 2).sum(-1)
    assert dist.min(axis=1).max() < 1e-8
    model2 = build_model(small_config(variant="continual_nystrom")).eval()
    model2.load_state_dict({k: v for k, v in model.state_dict().items()
                            if "fixed" not in k and "has_fixed" not in k}, strict=False)
    fit_fixed_landmarks(model2, train, seed=7)
    torch.testing.assert_close(model2.blocks[0].attn.fixed_q_land, first)


def test_state_memory_is_reported_and_fixed_state_does_not_grow_with_window():
    sizes = {}
    for n in (12, 48):
        model = build_model(small_config(variant="continual_nystrom", window=n)).eval()
        model.reset(1)
        for _ in range(n + 2):
            model.step(torch.randn(1, 16))
        sizes[n] = model.state_nbytes()
    assert sizes[12] > 0 and sizes[48] > sizes[12]     # the key/value ring grows with n


def test_fixed_mode_needs_fitted_landmarks():
    model = build_model(small_config(variant="continual_nystrom"))
    with pytest.raises(ValueError, match="fitted landmarks"):
        model.set_landmark_mode("fixed")


@pytest.mark.parametrize("kw,match", [
    (dict(variant="sparse"), "valid: regular, continual, nystrom, continual_nystrom"),
    (dict(variant="nystrom", landmark_mode="continual"), "valid"),
    (dict(layers=3), "layers must be 1 or 2"),
    (dict(window=0), "window"),
    (dict(num_landmarks=13), "1 <= m <= window"),
    (dict(num_landmarks=0), "1 <= m <= window"),
    (dict(pos_encoding="rope"), "pos_encoding"),
])
def test_bad_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        small_config(**kw)


def test_model_bad_inputs():
    model = build_model(small_config(variant="continual")).eval()
    with pytest.raises(RuntimeError, match="before reset"):
        model.step(torch.randn(1, 16))
    model.reset(2)
    with pytest.raises(ValueError, match=r"\(B, 16\)"):
        model.step(torch.randn(2, 15))
    with pytest.raises(ValueError, match="batch"):
        model.step(torch.randn(3, 16))
    with pytest.raises(ValueError, match="float64"):
        model.step(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="at most 12"):
        model(torch.randn(1, 13, 16))


def test_landmark_updates_are_reported_every_n_over_m_steps_once_the_window_is_full():
    torch.manual_seed(0)
    model = build_model(small_config(variant="continual_nystrom", window=12, num_landmarks=3)).eval()
    model.reset(1)
    updated = []
    for t in range(1, 49):
        model.step(torch.randn(1, 16))
        if model.landmark_updated():
            updated.append(t)
    assert updated == [16, 20, 24, 28, 32, 36, 40, 44, 48]       # n/m = 4; t = n is a warm-up rebuild
    fit_fixed_landmarks(model, torch.randn(4, 12, 16))
    model.reset(1)
    for _ in range(30):
        model.step(torch.randn(1, 16))
        assert not model.landmark_updated()


def test_config_is_frozen_and_derived_with_replace():
    import dataclasses
    cfg = small_config(variant="continual_nystrom")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.window = 99
    fixed = cfg.replace(landmark_mode="fixed", layers=2)
    assert (cfg.landmark_mode, fixed.landmark_mode) == (None, "fixed")
    assert fixed.key == "continual_nystrom/fixed 2-block" and cfg.key == "continual_nystrom"
    assert cfg.table_row == "continual_nystrom/continual" and fixed.table_row == "continual_nystrom/fixed"
    assert small_config(variant="nystrom").table_row == "nystrom"
    assert fixed.description == "continual_nystrom/fixed (2 blocks, n=12, m=3)"
    with pytest.raises(ValueError, match="valid"):
        cfg.replace(landmark_mode="segment")


def test_build_model_seed_is_private_and_reproducible():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_model(small_config(variant="continual"), seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)       # the global RNG is untouched
    b = build_model(small_config(variant="continual"), seed=3)
    c = build_model(small_config(variant="continual"), seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_fixed_config_starts_fixed_and_needs_its_landmarks():
    cfg = small_config(variant="continual_nystrom", landmark_mode="fixed")
    model = build_model(cfg, seed=0).eval()
    assert model.landmark_mode == "fixed" and not model.has_fixed_landmarks
    with pytest.raises(ValueError, match="not fitted"):
        model.reset(1)
    with pytest.raises(ValueError, match="not fitted"):
        model(torch.randn(1, 5, 16))
    fitted = build_model(small_config(variant="continual_nystrom"), seed=0).eval()
    fit_fixed_landmarks(fitted, torch.randn(10, 12, 16), seed=0)
    model.load_state_dict(fitted.state_dict())          # landmarks from a state dict: runs fixed
    assert model.landmark_mode == "fixed" and model.has_fixed_landmarks
    assert_step_equals_forward(model, torch.randn(1, 20, 16))
    model.set_landmark_mode("continual")                # a live switch is state, not identity
    assert model.landmark_mode == "continual" and model.cfg.landmark_mode == "fixed"


def test_absent_landmarks_leave_the_present_ones_pseudo_inverse_and_exact_zeros_off_it():
    """The warm-up with fewer landmarks than m (models/stream/nystrom.install with ``present``):
    absent landmarks padded as the identity leave the present ones' pseudo-inverse as it is."""
    from models.sda.reference import landmark_pinv
    from models.stream.nystrom import install
    g = torch.Generator().manual_seed(0)
    H, m, dh = 4, 5, 12
    for c in range(1, m + 1):
        ql, kl = (torch.randn(1, H, m, dh, generator=g) * 3 for _ in range(2))
        ql[:, :, c:], kl[:, :, c:] = 0, 0                         # as the warm-up pads them
        z = install(ql, kl, 6, (torch.arange(m) < c).view(1, m))[2][0]       # (H, m, m) float64
        want = landmark_pinv(ql[0, :, :c], kl[0, :, :c], 6).double()
        # the same float64 iteration on the same block, rounded to float32: the block may
        # differ only by the summation order of the padded products (an ulp of float64)
        torch.testing.assert_close(z[:, :c, :c], want, rtol=0, atol=4 * torch.finfo(torch.float32).eps * want.abs().max().item())
        assert (z[:, :c, c:] == 0).all() and (z[:, c:, :c] == 0).all()
        if c == m:                                          # all present: landmark_pinv itself
            torch.testing.assert_close(z, want, rtol=0, atol=4 * torch.finfo(torch.float32).eps * want.abs().max().item())
