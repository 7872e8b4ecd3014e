"""The float32 error model that every attention tolerance of the suite is derived from.

A float32 path and its float64 reference differ by the rounding of each float32 operation (at
most EPS32 / 2 relative each, EPS32 = 2^-23 = 1.19e-7), carried through the computation:

- a score s = q.k / sqrt(d) is a d-term dot product: its absolute error is at most about
  EPS32 * |q| |k| / sqrt(d) (Cauchy-Schwarz), so it grows with the score bound
  S = max |q_i| |k_j| / sqrt(d) over the window (the "score swing");
- exp turns an absolute score error into the same relative error of a weight, and an attention
  output is a convex combination of values: its error is about EPS32 * (1 + S) * V, V = max |v|;
- a sum of N terms (a window of n tokens, a running sum carried through T updates) adds rounding
  growing like sqrt(N) for independent roundings (N in the worst case; the worst case needs
  every rounding in one direction, which random inputs do not give);
- a Nystrom output multiplies three factors and an iterated pseudo-inverse, each a chain of the
  same operations: a constant number of such chains.

So a tolerance is ``K * EPS32 * magnitude * sqrt(terms)``, with the magnitude and the terms of the
computation at hand and K a small count of chained stages. `make tolerances` runs every such check
on 20 seeds and prints the worst observed error against its tolerance (goal: a margin >= 3).
"""
import math

import torch

EPS32 = torch.finfo(torch.float32).eps        # 1.19e-7


def score_bound(q: torch.Tensor, k: torch.Tensor) -> float:
    """max |q_i| |k_j| / sqrt(d) over all rows of q (..., Tq, d) and k (..., Tk, d): no score of
    any window of these rows is larger."""
    return (q.norm(dim=-1).max() * k.norm(dim=-1).max()).item() / math.sqrt(q.shape[-1])


def attention_tol(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, terms: int, stages: int) -> float:
    """Absolute tolerance of a float32 attention output against float64: ``stages`` chained
    float32 stages, each ``EPS32 * (1 + S) * V``, accumulated over ``terms`` terms."""
    return stages * EPS32 * (1 + score_bound(q, k)) * v.abs().max().item() * math.sqrt(terms)


def relative_tol(score: float, terms: int, stages: int) -> float:
    """Tolerance relative to the output's scale (max(1, |out|)) for a model whose largest score
    in the window is ``score``: ``stages * EPS32 * (1 + score) * sqrt(terms)``."""
    return stages * EPS32 * (1 + score) * math.sqrt(terms)


def model_scores(model, window: torch.Tensor, start, marks=None) -> float:
    """The largest |score| of any head of any block of ``model`` (float64 preferably) on
    ``window`` (B, n_t, in_dim); block 1's output with the landmarks ``marks`` (default: those
    the model streams with)."""
    if marks is None and model.cfg.nystrom:
        marks = model.landmarks()
    h = model.pos(model.embed(window), start)
    worst = 0.0
    for i, block in enumerate(model.blocks):
        q, k, _ = block.attn.qkv(h)                                   # (H, n_t, dh)
        worst = max(worst, (q @ k.transpose(-1, -2)).abs().max().item() / math.sqrt(q.shape[-1]))
        if i + 1 < len(model.blocks):
            h = block(h, marks[i] if marks else None)
    return worst
