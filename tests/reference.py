"""Float64 oracles written from the definitions, independent of the streaming code."""
import torch

from models.landmarks import segment_sizes
from models.sda import attention, nystrom_attention, segment_means


def expected_continual_landmarks(q_hist, k_hist, n, m):
    """Landmarks after t = len(hist) tokens, straight from the definition.

    Warm-up (t < n): segment means of all t tokens with min(m, t) segments. Afterwards: the m most
    recent completed stream-aligned segments, segment j of size sizes[j % m], oldest first.
    """
    t = q_hist.shape[1]
    if t < n:
        mm = min(m, t)
        return segment_means(q_hist, mm), segment_means(k_hist, mm)
    sizes = segment_sizes(n, m)
    bounds, j = [0], 0
    while bounds[-1] + sizes[j % m] <= t:
        bounds.append(bounds[-1] + sizes[j % m])
        j += 1
    segs = list(zip(bounds[:-1], bounds[1:]))[-m:]
    ql = torch.stack([q_hist[:, a:b].mean(1) for a, b in segs], dim=1)
    kl = torch.stack([k_hist[:, a:b].mean(1) for a, b in segs], dim=1)
    return ql, kl


def window_reference(variant, mode, q, k, v, t, n, m, fixed=None):
    """Float64 output for all queries of the window ending at token t (0-based)."""
    lo = max(0, t + 1 - n)
    qw, kw, vw = q[:, lo:t + 1], k[:, lo:t + 1], v[:, lo:t + 1]
    if variant in ("regular", "continual"):
        return attention(qw, kw, vw)
    if mode == "fixed":
        ql, kl = (x.double().unsqueeze(0).expand(q.shape[0], -1, -1) for x in fixed)
    elif mode == "segment":
        mm = min(m, qw.shape[1])
        ql, kl = segment_means(qw, mm), segment_means(kw, mm)
    else:
        ql, kl = expected_continual_landmarks(q[:, :t + 1], k[:, :t + 1], n, m)
    return nystrom_attention(qw, kw, vw, ql, kl)
