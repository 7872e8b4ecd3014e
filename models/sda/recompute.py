"""The baselines: attention recomputed over the whole window at every step.

  regular   exact softmax attention, O(n^2 d) per step
  nystrom   Nyström attention with landmarks 'segment' (segment means of the window) or 'fixed';
            ``fused``: the landmarks' pseudo-inverse in the compiled kernel (models/fused/pinv.py)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import flops as F
from ..landmarks import segment_means
from .fixed import check_fixed_dim, check_mode, expand_fixed, init_landmarks
from .kernel import Ring, SDAKernel, StepReport, StreamState
from .reference import attention, inference, nystrom_attention


@dataclass
class WindowState(StreamState):
    ring: Ring | None = None            # queries, keys and values of the window
    q_land: Tensor | None = None        # (B, m', d) Nyström landmarks of the last step
    k_land: Tensor | None = None


class RecomputeKernel(SDAKernel):
    def _new_state(self) -> WindowState:
        return WindowState()

    def _allocate(self, d, device, dtype, window_input) -> None:
        B, n = self._batch, self.n
        self.st.ring = Ring(self._zeros(B, n, d), self._zeros(B, n, d), self._zeros(B, n, d))

    @inference
    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v: (B, d) -> (B, d), or (B, n_t, d) retroactive."""
        st, slot, _, n_t = self._advance(q, k, v)
        st.ring.write(slot, q, k, v)
        self.report = StepReport(n_t=n_t)
        out = self._attend(st, *st.ring.ordered(st.t))            # (B, n_t, d)
        return out if self.retroactive else out[:, -1]


class RegularKernel(RecomputeKernel):
    variant = "regular"

    def _attend(self, st, qw, kw, vw) -> Tensor:
        return attention(qw, kw, vw)

    def flops(self, r: StepReport) -> F.Flops:
        return F.regular_sda(r.n_t, self.st.d)


class NystromKernel(RecomputeKernel):
    variant = "nystrom"
    takes_landmarks = True

    def __init__(self, window: int, *, num_landmarks: int, landmark_mode: str = "segment",
                 fixed_landmarks=None, pinv_iters: int = 6, **kw):
        super().__init__(window, **kw)
        init_landmarks(self, num_landmarks, landmark_mode, fixed_landmarks, pinv_iters)

    def set_landmark_mode(self, mode: str, fixed_landmarks=None) -> None:
        self.fixed = check_mode(self, mode, fixed_landmarks)
        self.mode = mode

    def _check_more(self, d: int) -> None:
        check_fixed_dim(self, d)

    def _attend(self, st, qw, kw, vw) -> Tensor:
        n_t = qw.shape[1]
        if self.mode == "fixed":
            ql, kl = expand_fixed(self)
        else:
            ql, kl = segment_means(qw, min(self.m, n_t)), segment_means(kw, min(self.m, n_t))
        st.q_land, st.k_land = ql, kl
        z = None
        if self.fused and ql.dtype == torch.float32 and ql.device.type == "cpu":
            from ..fused.pinv import landmark_pinv      # the compiled pseudo-inverse, same result
            z = landmark_pinv(ql, kl, self.pinv_iters)[0]
        return nystrom_attention(qw, kw, vw, ql, kl, self.pinv_iters, z=z)

    def flops(self, r: StepReport) -> F.Flops:
        return F.nystrom_sda(r.n_t, self.st.d, self.st.q_land.shape[1], self.pinv_iters,
                             segment=self.mode == "segment")

    def landmarks(self):
        st = self.st
        return None if st is None or st.t == 0 else (st.q_land, st.k_land)
