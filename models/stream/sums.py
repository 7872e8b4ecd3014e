"""Numerically stable sliding-window softmax sums, the continual part of attention: for R rows
(the retroactive queries of a window, or the Nyström query landmarks) and the keys j of the
window,

    num[r] = sum_j exp(s_rj - ref[r]) v_j,     den[r] = sum_j exp(s_rj - ref[r]),

so that num / den is each row's softmax-weighted value. Why this is stable where the published
continual attention is not:

- ``ref[r]`` is a running maximum of the row's scores: a score above it rescales the row by
  exp(ref_old - ref_new) <= 1 first, so no exp() argument is positive and scores of any size
  (200, 1e4) cannot overflow float32.
- A departing key is removed with the very score it was added with (cached in ``key_scores``,
  never recomputed: at |score| ~ 200 one rounding step of a recomputed score changes its exp by
  1e-5). When the departing key carried most of a row's mass the difference loses precision:
  ``peak[r]`` is the largest ``den[r]`` since the row was last computed from scratch, and a row
  whose ``den < TAU * peak`` is recomputed from its cached scores (O(n dh) for that row).
- Rows that live for ever (Nyström rows with fixed landmarks) would accumulate the rounding of
  every add and remove: Nyström rows are float64 (the float32 term removed is the one that was
  added), so 10^5 steps do not drift. Retroactive rows live at most n steps and stay float32.

Each measure can be turned off (``Stability``) so that `bench` can show what it costs.

Shapes: S streams, H heads, R rows, n the window, dh the head width; scores are scaled
(q . k / sqrt(dh)) and float32, the sums in their own dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .ops import branch, cast, take, write

TAU = 1.0 / 16.0  # refresh a row when its denominator falls below TAU * its peak


@dataclass(frozen=True)
class Stability:
    """The three stability measures, each switchable (benchmarks only: turning one off loses the
    guarantee it gives)."""
    rescale: bool = True   # running-max references: no exp() argument above 0 (no overflow)
    refresh: bool = True   # rows recomputed from cached scores after cancellation
    wide: bool = True      # float64 running sums where rows live for ever (no drift)

    @staticmethod
    def of(setting: "bool | Stability") -> "Stability":
        """``True`` / ``False`` for all measures on / off, or a ``Stability`` as it is."""
        if isinstance(setting, Stability):
            return setting
        return Stability(bool(setting), bool(setting), bool(setting))


def fresh_rows(scores: Tensor, valid: Tensor, values: Tensor, dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Row sums from scratch over each stream's valid slots: scores (S, H, R, n), valid (S, n),
    values (S, H, n, dh) -> ref, den (S, H, R), num (S, H, R, dh) in ``dtype``."""
    s = cast(scores, dtype).masked_fill(~valid.view(valid.shape[0], 1, 1, -1), float("-inf"))
    ref = s.amax(dim=-1)
    e = torch.exp(s - ref.unsqueeze(-1))                 # exp(-inf) = 0: invalid slots add nothing
    return ref, e.sum(dim=-1), torch.matmul(e, cast(values, dtype))


def slide(here: Tensor, full: Tensor, scores: Tensor, v: Tensor, v_ring: Tensor, key_scores: Tensor,
          ref: Tensor, den: Tensor, num: Tensor, peak: Tensor, rescale: bool = True):
    """The departing key (where the window was ``full`` (S,)) leaves every row with the score it
    was added with, the newest key joins (a running-max rescale first), its scores are cached.
    here (S, n) the slot; scores (S, H, R) the newest key against every row; v (S, H, dh);
    v_ring (S, H, n, dh); key_scores (S, H, n, R). Returns the new v_ring, key_scores, ref, den,
    num, peak and (S,) whether a row of the stream was rescaled."""
    dt = ref.dtype
    e = torch.exp(cast(take(key_scores, here), dt) - ref)                          # (S, H, R)
    e = torch.where(full.view(-1, 1, 1), e, e.new_zeros(()))
    gone_v = cast(take(v_ring, here), dt)                                          # (S, H, dh)
    den = den - e
    num = num - e.unsqueeze(-1) * gone_v.unsqueeze(2)
    v_ring = write(here, v, v_ring)
    key_scores = write(here, scores, key_scores)
    s = cast(scores, dt)
    rescaled = (s > ref).flatten(1).any(dim=1) & rescale
    if rescale:
        top = torch.maximum(ref, s)
        factor = torch.exp(ref - top)                    # 1 where the reference stays
        den, peak, num, ref = den * factor, peak * factor, num * factor.unsqueeze(-1), top
    else:                                                # a row's first key sets its reference
        ref = torch.where(torch.isinf(ref), s, ref)
    e = torch.exp(s - ref)
    den = den + e
    num = num + e.unsqueeze(-1) * cast(v, dt).unsqueeze(2)
    return v_ring, key_scores, ref, den, num, torch.maximum(peak, den) if rescale else peak, rescaled


def refresh(valid: Tensor, key_scores: Tensor, v_ring: Tensor, ref, den, num, peak, events: str,
            rows: Tensor | None = None):
    """Rows whose denominator fell below TAU * peak (cancellation), recomputed from their cached
    scores over the valid slots (S, n); ``rows`` (S, R): the rows that may be (default all).
    Returns the rows' sums and (S,) how many rows of each stream were recomputed."""
    stale = den < TAU * peak
    if rows is not None:
        stale = stale & rows.unsqueeze(1)

    def recompute(valid, key_scores, v_ring, ref, den, num, peak, stale):
        r, d, nm = fresh_rows(key_scores.transpose(2, 3), valid, v_ring, ref.dtype)
        return (torch.where(stale, r, ref), torch.where(stale, d, den),
                torch.where(stale.unsqueeze(-1), nm, num), torch.where(stale, d, peak))

    def keep(valid, key_scores, v_ring, ref, den, num, peak, stale):
        return ref, den, num, peak

    count = stale.flatten(1).sum(dim=1)
    if events == "eager":                                # the stale rows only (a host read)
        s_idx, h_idx, r_idx = stale.nonzero(as_tuple=True)
        if len(s_idx):
            rows_scores = key_scores[s_idx, h_idx, :, r_idx]                      # (F, n)
            r, d, nm = fresh_rows(rows_scores.view(-1, 1, 1, rows_scores.shape[-1]), valid[s_idx],
                                  v_ring[s_idx, h_idx].unsqueeze(1), ref.dtype)
            ref, den, num, peak = ref.clone(), den.clone(), num.clone(), peak.clone()
            ref[s_idx, h_idx, r_idx], den[s_idx, h_idx, r_idx] = r.view(-1), d.view(-1)
            num[s_idx, h_idx, r_idx], peak[s_idx, h_idx, r_idx] = nm.view(len(s_idx), -1), d.view(-1)
        return ref, den, num, peak, count
    out = branch(stale.any(), recompute, keep, (valid, key_scores, v_ring, ref, den, num, peak, stale), events)
    return (*out, count)
