"""Continual SDA (Hedegaard et al.), exact, O(n dh) per step and head: the step functions and
their state.

- single-output: the newest query over the cached keys and values of the window;
- retroactive: every query of the window as a row of running sums (models/stream/sums.py,
  float32: a row lives at most n steps): the departing key removed with the scores it was
  added with, the newest key added to every row, the newest query's row from scratch.

Shapes: S streams, H heads, n the window, dh the head width; q, k, v (S, H, dh) the newest
token's; t (S,) its position. Ring slot t % n holds token t.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .ops import StateTensor, filled, fresh, slot_of, write
from .sums import Stability, fresh_rows, refresh, slide

F32 = torch.float32


class SingleOutputState(NamedTuple):
    k_ring: Tensor        # (S, H, n, dh)
    v_ring: Tensor        # (S, H, n, dh)

    @staticmethod
    def spec(H: int, n: int, dh: int) -> list[StateTensor]:
        return [StateTensor(name, (H, n, dh), F32) for name in SingleOutputState._fields]


class RetroactiveState(NamedTuple):
    q_ring: Tensor        # (S, H, n, dh)
    k_ring: Tensor        # (S, H, n, dh)
    v_ring: Tensor        # (S, H, n, dh)
    key_scores: Tensor    # (S, H, n keys, n rows) every scaled score, key-major
    ref: Tensor           # (S, H, n) the rows' running maxima
    den: Tensor           # (S, H, n)
    num: Tensor           # (S, H, n, dh)
    peak: Tensor          # (S, H, n)

    @staticmethod
    def spec(H: int, n: int, dh: int) -> list[StateTensor]:
        shapes = {"key_scores": (H, n, n), "ref": (H, n), "den": (H, n), "peak": (H, n)}
        return [StateTensor(name, shapes.get(name, (H, n, dh)), F32) for name in RetroactiveState._fields]


def single_output(state: SingleOutputState, t: Tensor, q: Tensor, k: Tensor, v: Tensor,
                  slots: Tensor, events: str = "eager") -> tuple[Tensor, SingleOutputState]:
    """The newest query over the window: (S, H, dh), and the next state. ``slots``: arange(n)."""
    k_ring, v_ring = fresh(t, list(state), events)
    here = slot_of(t, slots)
    k_ring, v_ring = write(here, k, k_ring), write(here, v, v_ring)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(k_ring, (q * scale).unsqueeze(-1)).squeeze(-1)               # (S, H, n)
    scores = scores.masked_fill(~filled(t, slots).unsqueeze(1), float("-inf"))
    a = torch.matmul(torch.softmax(scores, dim=-1).unsqueeze(2), v_ring).squeeze(2)
    return a, SingleOutputState(k_ring, v_ring)


def retroactive(state: RetroactiveState, t: Tensor, q: Tensor, k: Tensor, v: Tensor, slots: Tensor,
                events: str, stability: Stability = Stability()):
    """Every query of the window: (S, H, n, dh) in ring order (zeros at slots not filled), the
    next state, and per stream (S,) the rows refreshed and whether a row was rescaled."""
    q_ring, k_ring, v_ring, key_scores, ref, den, num, peak = fresh(t, list(state), events, inf=(4,))
    scale = 1.0 / math.sqrt(q.shape[-1])
    here, valid = slot_of(t, slots), filled(t, slots)
    n = slots.shape[0]
    q_ring, k_ring = write(here, q, q_ring), write(here, k, k_ring)
    column = torch.matmul(q_ring, k.unsqueeze(-1)).squeeze(-1) * scale                 # (S, H, n)
    v_ring, key_scores, ref, den, num, peak, rescaled = slide(
        here, t >= n, column, v, v_ring, key_scores, ref, den, num, peak, stability.rescale)
    row = torch.matmul(k_ring, q.unsqueeze(-1)).squeeze(-1) * scale                    # (S, H, n)
    key_scores = torch.where(here.view(-1, 1, 1, n), row.unsqueeze(-1), key_scores)    # the newest row
    r, d, nm = fresh_rows(row.unsqueeze(2), valid, v_ring, ref.dtype)                  # from scratch
    mine = here.unsqueeze(1)
    ref, den = torch.where(mine, r, ref), torch.where(mine, d, den)
    num, peak = torch.where(mine.unsqueeze(-1), nm, num), torch.where(mine, d, peak)
    refreshed = t.new_zeros(t.shape)
    if stability.refresh:
        ref, den, num, peak, refreshed = refresh(valid, key_scores, v_ring, ref, den, num, peak, events,
                                                 rows=valid & (t > 0).view(-1, 1))
    a = torch.where(valid.view(valid.shape[0], 1, -1, 1), num / den.unsqueeze(-1), num.new_zeros(()))
    return (a, RetroactiveState(q_ring, k_ring, v_ring, key_scores, ref, den, num, peak),
            refreshed, rescaled & (t > 0))

