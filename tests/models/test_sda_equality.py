"""Streaming equals batch, at every step, for every variant (float32 stream vs float64 oracle)."""
import pytest
import torch

from models.sda import LANDMARK_MODES, streaming_sda
from reference import expected_continual_landmarks, window_reference

TOL = 1e-5


def stream_errors(variant, mode, n, m, d, retroactive, *, B=2, steps=None, seed=0, fixed=None):
    steps = steps or 3 * n + 3
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, steps, d, generator=g, dtype=torch.float64) for _ in range(3))
    s = streaming_sda(variant, n, retroactive=retroactive,
                     num_landmarks=m if "nystrom" in variant else None, landmark_mode=mode,
                     fixed_landmarks=tuple(x.float() for x in fixed) if fixed else None)
    s.reset(B)
    worst = 0.0
    for t in range(steps):
        out = s.step(q[:, t].float(), k[:, t].float(), v[:, t].float())
        ref = window_reference(variant, mode, q, k, v, t, n, m, fixed)
        if not retroactive:
            ref = ref[:, -1]
        assert out.shape == ref.shape, (t, out.shape, ref.shape)
        worst = max(worst, (out.double() - ref).abs().max().item())
        if variant == "continual_nystrom" and mode == "continual":
            got = s.landmarks()
            want = expected_continual_landmarks(q[:, :t + 1], k[:, :t + 1], n, m)
            for g_, w_ in zip(got, want):
                assert g_.shape == w_.shape
                assert (g_.double() - w_).abs().max() < 1e-5, f"landmarks wrong at t={t}"
    return worst


LONG = pytest.mark.slow          # 240-token streams: in `make test`, not in `make test-fast`
GRID = [pytest.param(n, m, marks=LONG) if n == 240 else (n, m)
        for n in (1, 7, 120, 240) for m in (1, 2, 4, 7, 16) if m <= n]


@pytest.mark.parametrize("retroactive", [False, True])
@pytest.mark.parametrize("d", [12, 64, 192])
@pytest.mark.parametrize("n", [1, 7, 120, pytest.param(240, marks=LONG)])
@pytest.mark.parametrize("variant", ["regular", "continual"])
def test_exact_variants_equal_attention(variant, n, d, retroactive):
    assert stream_errors(variant, None, n, None, d, retroactive) <= TOL


@pytest.mark.parametrize("retroactive", [False, True])
@pytest.mark.parametrize("d", [12, 64, 192])
@pytest.mark.parametrize("n,m", GRID)
@pytest.mark.parametrize("variant", ["nystrom", "continual_nystrom"])
def test_nystrom_variants_equal_reference(variant, n, m, d, retroactive):
    mode = LANDMARK_MODES[variant][0]
    assert stream_errors(variant, mode, n, m, d, retroactive) <= TOL


@pytest.mark.parametrize("retroactive", [False, True])
@pytest.mark.parametrize("n,m", [(1, 1), (7, 2), (7, 7), (120, 4), (120, 7),
                                 pytest.param(240, 16, marks=LONG)])
@pytest.mark.parametrize("variant", ["nystrom", "continual_nystrom"])
def test_fixed_landmarks_equal_reference(variant, n, m, retroactive):
    d = 64
    g = torch.Generator().manual_seed(1)
    fixed = (torch.randn(m, d, generator=g, dtype=torch.float64),
             torch.randn(m, d, generator=g, dtype=torch.float64))
    assert stream_errors(variant, "fixed", n, m, d, retroactive, fixed=fixed) <= TOL


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


def test_live_landmark_switch_keeps_equality():
    """continual -> fixed -> continual mid-stream; every step still equals its reference."""
    n, m, d, B = 12, 3, 16, 2
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, 60, d, generator=g, dtype=torch.float64) for _ in range(3))
    fixed = (torch.randn(m, d, generator=g, dtype=torch.float64),
             torch.randn(m, d, generator=g, dtype=torch.float64))
    for retro in (False, True):
        s = streaming_sda("continual_nystrom", n, num_landmarks=m, retroactive=retro)
        s.reset(B)
        for t in range(60):
            if t == 20:
                s.set_landmark_mode("fixed", tuple(x.float() for x in fixed))
            if t == 40:
                s.set_landmark_mode("continual")
            out = s.step(q[:, t].float(), k[:, t].float(), v[:, t].float())
            mode = "fixed" if 20 <= t < 40 else "continual"
            ref = window_reference("continual_nystrom", mode, q, k, v, t, n, m, fixed)
            ref = ref if retro else ref[:, -1]
            assert (out.double() - ref).abs().max() <= TOL, (retro, t)


def test_step_window_equals_single_query_reference():
    """The layer after a retroactive one: newest query over a recomputed window; continual
    landmarks are the aligned segment means of that window (passed in, new every step)."""
    from models.landmarks import aligned_means, segment_means
    from models.sda import attention, nystrom_attention
    from models.sda.window import KeyValues
    n, m, d, B = 9, 3, 16, 2
    for variant in ("continual", "continual_nystrom"):
        s = streaming_sda(variant, n, num_landmarks=m if variant != "continual" else None)
        s.reset(B)
        for t in range(30):
            n_t = min(t + 1, n)
            qw, k, v = torch.randn(B, n_t, d), torch.randn(B, n_t, d), torch.randn(B, n_t, d)
            q = qw[:, -1]
            if variant == "continual":
                out = s.step_window(q, KeyValues(k, v))
                ref = attention(q.unsqueeze(1).double(), k.double(), v.double())[:, 0]
            else:
                out = s.step_window(q, KeyValues(k, v), landmarks=(aligned_means(qw, t + 1, m, n),
                                                                   aligned_means(k, t + 1, m, n)))
                ql, kl = s.landmarks()
                if (t + 1) % n == 0 or t + 1 < n:     # whole segments: the window's segment means
                    assert torch.allclose(ql, segment_means(qw, min(m, n_t)), atol=1e-6)
                    assert torch.allclose(kl, segment_means(k, min(m, n_t)), atol=1e-6)
                ref = nystrom_attention(q.unsqueeze(1).double(), k.double(), v.double(),
                                        ql.double(), kl.double())[:, 0]
            assert (out.double() - ref).abs().max() <= TOL
