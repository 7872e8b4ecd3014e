"""Nyström landmarks: segment sizes, stream-aligned continual landmarks (what the streaming step,
models/stream/nystrom.py, keeps), k-means fixed landmarks.

Continual landmarks (Carreto Picón et al.): the stream is cut into consecutive segments whose sizes
repeat the pattern of ``segment_sizes(n, m)`` (the first n % m segments one token longer). When a
segment completes, its mean becomes a new landmark and replaces the landmark of the segment m
places earlier (same slot, same size). After every n tokens the landmarks are exactly the segment
means of the window; in between they may include tokens that have already left the window.

Warm-up rule (fewer than m completed segments, i.e. t < n tokens seen): the landmarks are the
segment means of all t tokens seen so far with min(m, t) segments, recomputed each step. This is
exactly the batch ``nystrom`` reference on the partial window, and at t = n it coincides with the
first stream-aligned landmarks, so the switch is seamless.
"""
from __future__ import annotations

import torch
from torch import Tensor


def segment_sizes(n: int, m: int) -> list[int]:
    """Sizes of m consecutive segments of n tokens; the first n % m are one longer."""
    base, extra = divmod(n, m)
    return [base + 1] * extra + [base] * (m - extra)


def aligned_segments(t: int, n: int, m: int) -> list[tuple[int, int]]:
    """The segments whose means are the continual landmarks after t tokens, as (start, stop)
    ranges of the window (the newest min(t, n) tokens, oldest first), oldest segment first.

    Warm-up (t < n): min(m, t) segments of all t tokens (the ``segment_means`` pattern). Then: the
    m latest completed stream-aligned segments, the oldest clipped to the window (it keeps at
    least one token: the tokens after the last boundary are fewer than its size)."""
    check_landmarks(n, m)
    if t < n:
        sizes = segment_sizes(t, min(m, t))
        ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
        return [(e - z, e) for z, e in zip(sizes, ends)]
    sizes = segment_sizes(n, m)
    bounds = [0]
    for z in sizes:
        bounds.append(bounds[-1] + z)
    rem = t % n
    done = max(i for i, b in enumerate(bounds) if b <= rem)     # segments done in this cycle
    last = t - (rem - bounds[done])                              # the latest boundary (stream)
    ranges, stop = [], last
    for i in range(m):                                           # newest completed first
        size = sizes[(done - 1 - i) % m]
        ranges.append((stop - size, stop))
        stop -= size
    w0 = t - n                                                   # stream index of window slot 0
    return [(max(a, w0) - w0, b - w0) for a, b in reversed(ranges)]


def check_landmarks(n: int, m: int) -> None:
    if not isinstance(m, int) or m < 1 or m > n:
        raise ValueError(f"num_landmarks must be an int with 1 <= m <= window ({n}), got {m!r}")


def segment_means(x: Tensor, m: int) -> Tensor:
    """x: (B, n, d) -> (B, m, d) means of m consecutive segments (first n % m one longer)."""
    B, n, d = x.shape
    check_landmarks(n, m)
    base, extra = divmod(n, m)
    if extra == 0:
        return x.reshape(B, m, base, d).mean(dim=2)
    long = x[:, : extra * (base + 1)].reshape(B, extra, base + 1, d).mean(dim=2)
    short = x[:, extra * (base + 1):].reshape(B, m - extra, base, d).mean(dim=2)
    return torch.cat([long, short], dim=1)


# ----------------------------------------------------------------------------- fixed landmarks

@torch.no_grad()
def collect_qk(model, sequences: Tensor | list[Tensor], block: int,
               batch_size: int = 64) -> tuple[Tensor, Tensor]:
    """Q and K tokens entering ``block``'s attention for every window of ``sequences``.

    sequences: (N, T, in_dim), T <= window, or a list of such tensors (one per sequence length).
    Returns q, k: (heads, sum N * T, d_head).
    """
    groups = [sequences] if isinstance(sequences, Tensor) else list(sequences)
    attn = model.blocks[block].attn
    seen: list[Tensor] = []
    hook = attn.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    was_training = model.training
    model.eval()
    try:
        for seqs in groups:
            for i in range(0, seqs.shape[0], batch_size):
                model(seqs[i:i + batch_size])
    finally:
        hook.remove()
        model.train(was_training)
    H, dh = attn.heads, attn.d_head
    regroup = lambda t: t.reshape(-1, H, t.shape[1], dh).transpose(0, 1).reshape(H, -1, dh)  # noqa: E731
    qs, ks = [], []
    for x in seen:                                                # (b, T, d_model)
        q, k, _ = attn.qkv(x)                                     # (b * H, T, d_head)
        qs.append(regroup(q))
        ks.append(regroup(k))
    return torch.cat(qs, dim=1), torch.cat(ks, dim=1)


def kmeans_centres(tokens: Tensor, m: int, seed: int, max_tokens: int) -> Tensor:
    """scikit-learn KMeans centres of tokens (N, d) -> (m, d), on a seeded subset of max_tokens."""
    from sklearn.cluster import KMeans

    if tokens.shape[0] < m:
        raise ValueError(f"need at least m={m} tokens to fit landmarks, got {tokens.shape[0]}")
    g = torch.Generator().manual_seed(seed)
    if tokens.shape[0] > max_tokens:
        tokens = tokens[torch.randperm(tokens.shape[0], generator=g)[:max_tokens]]
    km = KMeans(n_clusters=m, n_init=4, random_state=seed).fit(tokens.double().cpu().numpy())
    return torch.as_tensor(km.cluster_centers_, dtype=tokens.dtype)


def fit_fixed_landmarks(model, sequences: Tensor | list[Tensor], *, seed: int = 0,
                        max_tokens: int = 20000) -> None:
    """Second training phase of Carreto Picón et al.: k-means landmarks per head, block by block.

    For each block in order (first block first, so later blocks see the earlier blocks' fixed
    landmarks), collect Q/K tokens of ``sequences`` (N, T <= n, in_dim) or a list of such
    tensors, cluster them per head into
    m centres with KMeans (seeded), install them and switch that block to landmark mode 'fixed'
    (model state; the model's config, its identity, is not changed).
    The pseudo-inverse is computed once when a stream starts. Fine-tuning is left to the caller.
    """
    if model.cfg.variant not in ("nystrom", "continual_nystrom"):
        raise ValueError(f"variant {model.cfg.variant!r} has no landmarks")
    m = model.cfg.num_landmarks
    for i, block in enumerate(model.blocks):
        q, k = collect_qk(model, sequences, i)
        device, dtype = block.attn.in_proj.weight.device, block.attn.in_proj.weight.dtype
        qc = torch.stack([kmeans_centres(q[h], m, seed + h, max_tokens) for h in range(q.shape[0])])
        kc = torch.stack([kmeans_centres(k[h], m, seed + 1000 + h, max_tokens) for h in range(k.shape[0])])
        block.attn.set_fixed_landmarks(qc.to(device, dtype), kc.to(device, dtype))
