"""Continual SDA (Hedegaard et al.): exact, O(n d) per step.

  single-output  the newest query over the cached keys and values
  retroactive    every query of the window, updated by removing the departing key's term and
                 adding the newest key's (running sums, models/running_sums.py), plus the newest
                 query's row from scratch
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .. import flops as F
from ..running_sums import (RunningSums, SumsScratch, add_key, fresh_sums, refresh_stale,
                            remove_key)
from .kernel import Ring, SDAKernel, StepReport, StreamState, fused_kernels, window_order
from .reference import attention, inference


@dataclass
class ContinualState(StreamState):
    ring: Ring | None = None             # keys, values (and queries when retroactive)
    rows: RunningSums | None = None      # retroactive: one row per query slot
    scores: Tensor | None = None         # (B, n, n) retroactive: cached scaled score of query
                                         #   slot i against key slot j (removed exactly as added)
    scratch: SumsScratch | None = None   # retroactive: step buffers for the n rows


class ContinualKernel(SDAKernel):
    variant = "continual"

    def _new_state(self) -> ContinualState:
        self._arrays = None
        return ContinualState()

    def _allocate(self, d, device, dtype, window_input) -> None:
        if window_input:
            return
        B, n = self._batch, self.n
        self.st.ring = Ring(self._zeros(B, n, d), self._zeros(B, n, d),
                            self._zeros(B, n, d) if self.retroactive else None)
        if self.retroactive:
            self.st.rows = RunningSums.empty(B, n, d, device, dtype)
            self.st.scores = self._zeros(B, n, n)
            self.st.scratch = SumsScratch.like(self.st.rows)

    def steady_next(self) -> bool:
        """Whether the fused kernel can take the next step (single-output, after the first)."""
        return self.st is not None and self.st.ring is not None and not self.retroactive

    def fused_begin(self) -> tuple[int, int]:
        """Count a token taken by the fused kernel: (ring slot, n_t)."""
        st = self.st
        slot = st.t % self.n
        st.t += 1
        n_t = min(st.t, self.n)
        self.report = StepReport(n_t=n_t)
        return slot, n_t

    def fused_arrays(self) -> tuple:
        """Numpy views of the ring for models/fused/kernels.continual_step, and a score buffer."""
        ring = self.st.ring
        if self._arrays is None or self._arrays[0].shape[0] != ring.k.shape[0]:
            self._arrays = (ring.k.numpy(), ring.v.numpy(), np.empty(self.n, np.float32))
        return self._arrays

    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v: (B, d) -> (B, d) single-output, or (B, n_t, d) retroactive."""
        arrays = self._as_arrays(q, k, v) if self._fusable() and self.steady_next() else None
        if arrays is not None:
            out = np.empty(arrays[0].shape, np.float32)
            slot, n_t = self.fused_begin()
            ring_k, ring_v, scores = self.fused_arrays()
            fused_kernels().continual_step(*arrays, ring_k, ring_v, slot, n_t, scores, out)
            return torch.from_numpy(out)
        return self._step(q, k, v)

    @inference
    def _step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        st, slot, full, n_t = self._advance(q, k, v)
        if self.retroactive:
            return self._retroactive(st, q, k, v, slot, full, n_t)
        st.ring.write(slot, q, k, v)
        self.report = StepReport(n_t=n_t)
        return attention(q.unsqueeze(1), st.ring.k[:, :n_t], st.ring.v[:, :n_t])[:, 0]

    def _retroactive(self, st: ContinualState, q, k, v, slot: int, full: bool, n_t: int) -> Tensor:
        scale, ring = 1.0 / math.sqrt(st.d), st.ring
        rows, S, scratch = st.rows.view(n_t), st.scores, st.scratch.view(n_t)
        rescaled = False
        if full:    # the departing key leaves every row (with the scores it was added with)
            remove_key(rows, S[:, :n_t, slot], ring.v[:, slot], scratch)
        ring.write(slot, q, k, v)
        if st.t > 1:    # the new key joins every row (the row in `slot` is overwritten below)
            column = torch.bmm(ring.q[:, :n_t], k.unsqueeze(-1)).squeeze(-1) * scale    # (B, n_t)
            rescaled = add_key(rows, column, v, self.stability.rescale, scratch)
            S[:, :n_t, slot] = column
        row = torch.bmm(ring.k[:, :n_t], q.unsqueeze(-1)).squeeze(-1) * scale          # (B, n_t)
        S[:, slot, :n_t] = row                     # the newest query's row, from scratch
        rows.assign_((slice(None), slot), fresh_sums(row.unsqueeze(1), ring.v[:, :n_t]))
        refreshed = 0
        if self.stability.refresh and st.t > 1:
            refreshed = refresh_stale(rows, lambda b, r: S[b, r, :n_t], ring.v, n_t, scratch)
        self.report = StepReport(n_t=n_t, first=st.t == 1, evicted=full, rescaled=rescaled, rows_refreshed=refreshed)
        return rows.output()[:, window_order(st.t, self.n, q.device)]

    @inference
    def step_window(self, q: Tensor, kv) -> Tensor:
        """Newest query over a recomputed window. q: (B, d), kv: KeyValues / FoldedKeyValues
        (models/sda/window.py) of (B, n_t, d) keys and values -> (B, d)."""
        self._advance_window(q, kv)
        self.report = StepReport(n_t=kv.n_t)
        qs = q.unsqueeze(1) * (1.0 / math.sqrt(q.shape[-1]))
        return kv.mix(torch.softmax(kv.scores(qs), dim=-1))[:, 0]

    def flops(self, r: StepReport) -> F.Flops:
        if not self.retroactive:
            return F.continual_sda(r.n_t, self.st.d)
        return F.continual_retroactive_sda(r.n_t, self.st.d, first=r.first, evict=r.evicted,
                                           stabilize=self.stability.refresh, rescaled=r.rescaled)
