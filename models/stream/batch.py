"""Many streams of one model stepped as one batch: a slot per stream, each with its own position,
warm-up and events, so that streams join and leave at any step without touching the others.

Continual variants: the slots hold the explicit state of the model's step graph
(models/stream/, the graph the ONNX export writes) stacked along a slot axis, and one
call of ``torch.func.vmap`` over the graph steps every stream given. The graph's rare events
(a stale row recomputed, a continual landmark replaced, a warm-up rebuild) are masks here
(``masked=True``: both branches, a per-stream select), never Python branches: a step has no
host synchronisation, and a stream's event changes no other stream's values.

Recomputing variants (regular, nystrom): a slot holds the stream's last n tokens (a ring); a
step recomputes each stream's window with the model's batch forward, one call per window length
(streams in warm-up have fewer than n tokens; past it, one call for all).

A stream starts when it joins: its position is set to 0, and the graph replaces every state
tensor by zeros at position 0, so a slot left by another stream needs no clearing.

Shapes: S streams stepped, C slots; tokens (S, in_dim), logits (S, classes).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import flops as F
from .graph import EXPORTABLE
from .two_block import stream_graph


class SlotsFull(RuntimeError):
    """Every slot holds a stream."""


class StreamBatch:
    """C slots of one model (a GenreTransformer in eval mode; its weights are shared, not copied)."""

    def __init__(self, model, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.model, self.cfg, self.capacity = model, model.cfg, capacity
        device = next(model.parameters()).device
        self.t = torch.zeros(capacity, dtype=torch.int64, device=device)        # (C,) next position
        self.taken = [False] * capacity
        self.continual = self.cfg.variant in EXPORTABLE
        if self.continual:
            self.graph = stream_graph(model, masked=True).eval()
            self.state = [torch.zeros((capacity, *s.shape), dtype=s.dtype, device=device)
                          for s in self.graph.state_spec()]
            self.batched = torch.func.vmap(self.graph.forward)
        else:
            self.ring = torch.zeros(capacity, self.cfg.window, self.cfg.in_dim, device=device)   # (C, n, D)
        self.events = torch.zeros(0, 3, dtype=torch.int64)     # (S, 3) of the last step (continual)
        self.stepped = torch.zeros(0, dtype=torch.int64)       # (S,) positions + 1 after the last step
        self.mode = model.landmark_mode
        self._flops: dict[tuple, dict[str, int]] = {}          # (position up to n + 1, events) -> FLOPs
        per_slot = ([math.prod(s.shape) * s.dtype.itemsize for s in self.graph.state_spec()]
                    if self.continual else [self.cfg.window * self.cfg.in_dim * 4])
        self.slot_nbytes = sum(per_slot)

    # ------------------------------------------------------------------ slots
    def join(self) -> int:
        """A free slot for a new stream (its position 0)."""
        try:
            slot = self.taken.index(False)
        except ValueError:
            raise SlotsFull(f"all {self.capacity} slots hold a stream") from None
        self.taken[slot] = True
        self.t[slot] = 0
        return slot

    def leave(self, slot: int) -> None:
        self.taken[slot] = False

    @property
    def streams(self) -> int:
        return sum(self.taken)

    # ------------------------------------------------------------------ what the last step did
    def step_flops(self, i: int) -> dict[str, int]:
        """FLOPs of the last step of the i-th stream stepped (models/flops.py: the formulas of the
        single-stream step for its position and events; the masked branches not taken are not
        counted). They depend on the position only up to n + 1, so each count is made once."""
        t = min(int(self.stepped[i]), self.cfg.window + 1)
        key = (t, tuple(self.events[i].tolist())) if self.continual else (t,)
        if key not in self._flops:
            detail = (F.graph_step(self.cfg, self.mode, t, key[1]) if self.continual
                      else F.recompute_step(self.cfg, min(t, self.cfg.window), self.mode))
            self._flops[key] = {k: v.total for k, v in detail.items()}
        return dict(self._flops[key])

    def landmark_updated(self, i: int) -> bool:
        return self.continual and bool(self.events[i, 1])

    def window_full(self, i: int) -> bool:
        return int(self.stepped[i]) >= self.cfg.window

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, slots: Tensor, tokens: Tensor) -> Tensor:
        """One token for each stream in ``slots`` (S,) -> its logits (S, classes)."""
        if self.continual:
            return self._continual(slots, tokens)
        return self._recompute(slots, tokens)

    def _continual(self, slots: Tensor, tokens: Tensor) -> Tensor:
        state = [s.index_select(0, slots) for s in self.state]
        logits, t_next, self.events, *state = self.batched(tokens.unsqueeze(1), self.t.index_select(0, slots), *state)
        for whole, part in zip(self.state, state):
            whole.index_copy_(0, slots, part)
        self.t.index_copy_(0, slots, t_next)
        self.stepped = t_next
        return logits.squeeze(1)

    def _recompute(self, slots: Tensor, tokens: Tensor) -> Tensor:
        n, period = self.cfg.window, self.cfg.period
        t = self.t.index_select(0, slots)                                        # (S,)
        self.ring[slots, t % n] = tokens
        self.t.index_copy_(0, slots, t + 1)
        self.stepped = t + 1
        n_t = torch.clamp(t + 1, max=n)
        logits = tokens.new_empty(len(slots), self.cfg.num_classes)
        for length in torch.unique(n_t).tolist():                  # past warm-up: one length
            rows = torch.nonzero(n_t == length).squeeze(1)
            first = t.index_select(0, rows) + 1 - length                        # (R,) oldest position
            order = (first.unsqueeze(1) + torch.arange(length, device=t.device)) % n          # (R, length)
            window = self.ring[slots.index_select(0, rows).unsqueeze(1), order]              # (R, length, D)
            logits[rows] = self.model(window, start=first % period)
        return logits
