"""Streaming equals batch, at every step, for every variant (float32 stream vs float64 oracle).

Tolerances follow tests/error_model.py: an attention output's error is EPS32 (1 + S) V per
float32 stage, S the score bound and V the largest value, accumulated over every update of the
stream since its reset (``steps`` terms); a landmark is a mean, EPS32 |q| per stage."""
import math

import pytest
import torch

from error_model import EPS32, attention_tol
from models.sda import LANDMARK_MODES
from app.bench.sda import streaming_sda
from reference import expected_continual_landmarks, window_reference

STAGES = {"regular": 3, "continual": 3,        # scores, softmax sums, the division
          "nystrom": 6, "continual_nystrom": 6}  # three softmax factors, the pseudo-inverse, two products


def mean_tol(x: torch.Tensor, terms: int) -> float:
    """A mean of float32 rows of ``x`` against float64: a sum and a division over ``terms``."""
    return 2 * EPS32 * x.abs().max().item() * math.sqrt(terms)


def stream_errors(variant, mode, n, m, d, retroactive, errors, *, B=2, steps=None, seed=0, fixed=None):
    """Stream 3n + 3 random tokens; every step's output (and continual landmarks) must be within
    its tolerance of the float64 window reference."""
    steps = steps or 3 * n + 3
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, steps, d, generator=g, dtype=torch.float64) for _ in range(3))
    s = streaming_sda(variant, n, retroactive=retroactive,
                     num_landmarks=m if "nystrom" in variant else None, landmark_mode=mode,
                     fixed_landmarks=tuple(x.float() for x in fixed) if fixed else None)
    s.reset(B)
    tol = attention_tol(q, k, v, steps, STAGES[variant])
    landmark_tol = mean_tol(torch.cat([q, k]), steps)
    worst, worst_landmark = (0.0, -1), (0.0, -1)
    for t in range(steps):
        out = s.step(q[:, t].float(), k[:, t].float(), v[:, t].float())
        ref = window_reference(variant, mode, q, k, v, t, n, m, fixed)
        if not retroactive:
            ref = ref[:, -1]
        assert out.shape == ref.shape, (t, out.shape, ref.shape)
        worst = max(worst, ((out.double() - ref).abs().max().item(), t))
        if variant == "continual_nystrom" and mode == "continual":
            got = s.landmarks()
            want = expected_continual_landmarks(q[:, :t + 1], k[:, :t + 1], n, m)
            for g_, w_ in zip(got, want):
                assert g_.shape == w_.shape
                worst_landmark = max(worst_landmark, ((g_.double() - w_).abs().max().item(), t))
    name = f"stream {variant}/{mode} {'retroactive' if retroactive else 'single-output'}"
    errors(name, worst[0], tol, where=f"at step {worst[1]} (n={n}, m={m}, d={d})")
    if worst_landmark[1] >= 0:
        errors("continual landmarks (stream segment means)", worst_landmark[0], landmark_tol,
               where=f"at step {worst_landmark[1]}")


LONG = pytest.mark.slow          # 240-token streams: in `make test`, not in `make test-fast`
# one case per distinct behaviour: a single token; one landmark; m dividing n; m not dividing n
# (uneven segments); m = n (every token a landmark); a long window with many landmarks
GRID = [(1, 1), (7, 2), (7, 7), (120, 1), (120, 4), (120, 7), pytest.param(240, 16, marks=LONG)]
DIMS = [12, 192]                 # a small head and the paper's width


@pytest.mark.parametrize("retroactive", [False, True])
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n", [1, 7, 120, pytest.param(240, marks=LONG)])
@pytest.mark.parametrize("variant", ["regular", "continual"])
def test_exact_variants_equal_attention(variant, n, d, retroactive, seed, errors):
    stream_errors(variant, None, n, None, d, retroactive, errors, seed=seed)


@pytest.mark.parametrize("retroactive", [False, True])
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("n,m", GRID)
@pytest.mark.parametrize("variant", ["nystrom", "continual_nystrom"])
def test_nystrom_variants_equal_reference(variant, n, m, d, retroactive, seed, errors):
    mode = LANDMARK_MODES[variant][0]
    stream_errors(variant, mode, n, m, d, retroactive, errors, seed=seed)


@pytest.mark.parametrize("retroactive", [False, True])
@pytest.mark.parametrize("n,m", [(1, 1), (7, 2), (7, 7), (120, 4), (120, 7),
                                 pytest.param(240, 16, marks=LONG)])
@pytest.mark.parametrize("variant", ["nystrom", "continual_nystrom"])
def test_fixed_landmarks_equal_reference(variant, n, m, retroactive, seed, errors):
    d = 64
    g = torch.Generator().manual_seed(seed + 1)
    fixed = (torch.randn(m, d, generator=g, dtype=torch.float64),
             torch.randn(m, d, generator=g, dtype=torch.float64))
    stream_errors(variant, "fixed", n, m, d, retroactive, errors, fixed=fixed, seed=seed)


def test_continual_landmarks_are_window_segments_every_n_steps():
    """At t = c * n the stream-aligned landmarks are exactly the window's segment means."""
    from models.landmarks import segment_means
    n, m, d = 10, 3, 8
    s = streaming_sda("continual_nystrom", n, num_landmarks=m)
    s.reset(1)
    x = torch.randn(1, 3 * n, 3, d)
    for t in range(3 * n):
        s.step(x[:, t, 0], x[:, t, 1], x[:, t, 2])
        if (t + 1) % n == 0:
            ql, kl = s.landmarks()
            win = x[:, t + 1 - n:t + 1]
            torch.testing.assert_close(ql, segment_means(win[:, :, 0], m))
            torch.testing.assert_close(kl, segment_means(win[:, :, 1], m))
        if (t + 1) % n == 1 and t > n:   # just after a boundary: a landmark holds departed tokens
            ql, _ = s.landmarks()
            assert not torch.allclose(ql, segment_means(x[:, t + 1 - n:t + 1, 0], m))


def test_live_landmark_switch_keeps_equality(seed, errors):
    """continual -> fixed -> continual mid-stream; every step still equals its reference."""
    n, m, d, B = 12, 3, 16, 2
    g = torch.Generator().manual_seed(seed + 3)
    q, k, v = (torch.randn(B, 60, d, generator=g, dtype=torch.float64) for _ in range(3))
    fixed = (torch.randn(m, d, generator=g, dtype=torch.float64),
             torch.randn(m, d, generator=g, dtype=torch.float64))
    tol = attention_tol(q, k, v, 60, STAGES["continual_nystrom"])
    for retro in (False, True):
        s = streaming_sda("continual_nystrom", n, num_landmarks=m, retroactive=retro)
        s.reset(B)
        worst = 0.0
        for t in range(60):
            if t == 20:
                s.set_landmark_mode("fixed", tuple(x.float() for x in fixed))
            if t == 40:
                s.set_landmark_mode("continual")
            out = s.step(q[:, t].float(), k[:, t].float(), v[:, t].float())
            mode = "fixed" if 20 <= t < 40 else "continual"
            ref = window_reference("continual_nystrom", mode, q, k, v, t, n, m, fixed)
            ref = ref if retro else ref[:, -1]
            worst = max(worst, (out.double() - ref).abs().max().item())
        errors("live landmark switches, continual nystrom", worst, tol)


