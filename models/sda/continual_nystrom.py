"""Continual Nyström SDA (Carreto Picón et al.): s(q K~^T) s(Q~ K~^T)^+ s(Q~ K^T) V per token.

The m rows of s(Q~ K^T) V are running sums (models/running_sums.py): each step removes the
departing key's term and adds the newest key's, O(m d). Landmarks are
  'continual'  stream-aligned segment means (models/landmarks.py): one replaced every n/m steps,
               with its pseudo-inverse and its row recomputed over the window; during warm-up
               (t < n) everything is rebuilt each step from the partial window's segment means;
  'fixed'      k-means centres from training: nothing but the rows changes, and m add-only
               shadow rows replace them every n steps so rounding never accumulates (no drift).
The steady step (no landmark change) allocates nothing but its output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import flops as F
from ..landmarks import ContinualLandmarks
from ..running_sums import (RunningSums, SumsScratch, add_key, fresh_sums, refresh_stale,
                            remove_key)
from .fixed import check_fixed_dim, check_mode, expand_fixed, init_landmarks
from .kernel import Ring, SDAKernel, StepReport, StreamState, window_order
from .reference import inference, landmark_pinv


@dataclass
class Landmarks:
    """The landmarks in use and what is derived from them; m' = min(m, t) during warm-up."""
    q: Tensor           # (B, m', d) query landmarks, unscaled
    k: Tensor           # (B, m', d) key landmarks, unscaled
    q_scaled: Tensor    # (B, m', d) q / sqrt(d)
    k_scaled_t: Tensor  # (B, d, m') (k / sqrt(d))^T, contiguous
    z: Tensor           # (B, m', m') pinv(s(Q~ K~^T))
    logits: Tensor      # (B, 1, m') step buffers of the output s(q K~^T) Z / den
    probs: Tensor       # (B, 1, m')
    c: Tensor           # (B, 1, m')

    @staticmethod
    def install(q: Tensor, k: Tensor, iters: int) -> "Landmarks":
        s = 1.0 / math.sqrt(q.shape[-1])
        B, m = q.shape[:2]
        buf = lambda: q.new_empty(B, 1, m)  # noqa: E731
        return Landmarks(q.clone(), k.clone(), q * s, (k * s).transpose(1, 2).contiguous(),
                         landmark_pinv(q, k, iters), buf(), buf(), buf())


@dataclass
class LandmarkRows:
    """Running sums of s(Q~ K^T) V: the m main rows, then (fixed landmarks) m shadow rows that
    only ever add and replace the main rows after n keys."""
    sums: RunningSums            # (B, R) all rows, R = m or 2m
    main: RunningSums            # view of the first m rows
    shadow: RunningSums | None   # view of the shadow rows
    q_scaled: Tensor             # (B, R, d) the scaled query landmark of every row
    new_scores: Tensor           # (B, R, 1) step buffer: the newest key against every row
    scratch: SumsScratch         # step buffers for all rows
    scratch_main: SumsScratch    # step buffers for the main rows
    shadow_keys: int = 0         # keys added to the shadow rows since they were cleared


@dataclass
class ContinualNystromState(StreamState):
    ring: Ring | None = None             # keys, values (queries too when retroactive)
    key_scores: Tensor | None = None     # (B, n, m) scaled score of each key slot against Q~
    marks: Landmarks | None = None
    rows: LandmarkRows | None = None     # None in a window-fed kernel
    p: Tensor | None = None              # (B, n, m) retroactive: s(q_i K~^T) per query slot


class ContinualNystromKernel(SDAKernel):
    variant = "continual_nystrom"
    takes_landmarks = True

    def __init__(self, window: int, *, num_landmarks: int, landmark_mode: str = "continual",
                 fixed_landmarks=None, pinv_iters: int = 6, **kw):
        super().__init__(window, **kw)
        self.tracker = ContinualLandmarks(window, num_landmarks)
        init_landmarks(self, num_landmarks, landmark_mode, fixed_landmarks, pinv_iters)

    def _new_state(self) -> ContinualNystromState:
        return ContinualNystromState()

    def _allocate(self, d, device, dtype, window_input) -> None:
        B, n = self._batch, self.n
        if not window_input:
            self.st.ring = Ring(self._zeros(B, n, d), self._zeros(B, n, d),
                                self._zeros(B, n, d) if self.retroactive else None)
            self.st.key_scores = self._zeros(B, n, self.m)
        self.tracker.reset(B, d, device, dtype)

    def _check_more(self, d: int) -> None:
        check_fixed_dim(self, d)

    def state_nbytes(self) -> int:
        return super().state_nbytes() + self.tracker.nbytes()

    # ------------------------------------------------------------------ landmarks
    def set_landmark_mode(self, mode: str, fixed_landmarks=None) -> None:
        """Switch landmark mode; allowed mid-stream (the next step uses the new landmarks)."""
        self.fixed = check_mode(self, mode, fixed_landmarks)
        changed = mode != self.mode or fixed_landmarks is not None
        self.mode = mode
        st = self.st
        if changed and st is not None and st.t > 0:
            if st.ring is None:          # window-fed: reinstall on the next step
                st.marks = None
            else:
                self._rebuild(st)

    def landmarks(self) -> tuple[Tensor, Tensor] | None:
        """(q_land, k_land) (B, m', d) the last step used (oldest segment first), or None."""
        st = self.st
        if st is None or st.t == 0:
            return None
        if self.mode == "continual":
            return self.tracker.chronological()
        return st.marks.q, st.marks.k

    def _source(self) -> tuple[Tensor, Tensor]:
        return expand_fixed(self) if self.mode == "fixed" else self.tracker.current()

    def _rebuild(self, st: ContinualNystromState) -> None:
        """Landmarks, pseudo-inverse and every row from scratch over the stored window."""
        st.marks = Landmarks.install(*self._source(), self.pinv_iters)
        n_t, m = min(st.t, self.n), self.m
        scores = torch.matmul(st.marks.q_scaled, st.ring.k[:, :n_t].transpose(1, 2))   # (B, m', n_t)
        fresh = fresh_sums(scores, st.ring.v[:, :n_t])
        if scores.shape[1] == m:
            st.key_scores[:, :n_t] = scores.transpose(1, 2)
        if self.mode == "fixed" and self.stabilize:
            sums = RunningSums.empty(self._batch, 2 * m, st.d, st.ring.k.device, st.ring.k.dtype)
            main, shadow = sums.view(m), sums.rows(m, 2 * m)
            main.copy_(fresh)
            q_rows = torch.cat([st.marks.q_scaled, st.marks.q_scaled], dim=1)
        else:
            sums = main = fresh
            shadow, q_rows = None, st.marks.q_scaled
        R = q_rows.shape[1]
        st.rows = LandmarkRows(sums, main, shadow, q_rows, q_rows.new_empty(self._batch, R, 1),
                               SumsScratch.like(sums), SumsScratch.like(main))
        st.p = None

    def _replace_landmark(self, st: ContinualNystromState, n_t: int) -> None:
        """A continual landmark replaced its slot: new pinv, its row over the window."""
        r = (self.tracker.state.completed - 1) % self.m
        st.marks = Landmarks.install(*self.tracker.current(), self.pinv_iters)
        st.rows.q_scaled = st.marks.q_scaled
        row_scores = torch.bmm(st.ring.k[:, :n_t], st.marks.q_scaled[:, r].unsqueeze(-1)).squeeze(-1)
        st.rows.sums.assign_((slice(None), r), fresh_sums(row_scores.unsqueeze(1), st.ring.v[:, :n_t]))
        st.key_scores[:, :n_t, r] = row_scores
        st.p = None

    # ------------------------------------------------------------------ stepping
    @inference
    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v: (B, d) -> (B, d) single-output, or (B, n_t, d) retroactive."""
        st, slot, full, n_t = self._advance(q, k, v)
        changed = self.tracker.push(q, k)
        fixed = self.mode == "fixed"
        warmup = not fixed and not self.tracker.warm
        just_warm = not fixed and changed and self.tracker.state.completed == self.m
        report = StepReport(n_t=n_t, evicted=full, warmup_landmarks=warmup)
        if st.rows is None or warmup or just_warm:
            # first step, or warm-up with continual landmarks: the landmarks change every step
            st.ring.write(slot, q, k, v)
            self._rebuild(st)
            report.event, report.evicted = "rebuild", False
        else:
            report.event, report.rescaled = self._update(st, q, k, v, slot, full)
            if not fixed and changed:
                self._replace_landmark(st, n_t)
                report.event = "landmark"
            if self.stabilize:
                report.rows_refreshed = refresh_stale(
                    st.rows.main, lambda b, r: st.key_scores[b, :n_t, r], st.ring.v, n_t,
                    st.rows.scratch_main)
        self.report = report
        if self.retroactive:
            return self._retroactive_output(st, q, slot, n_t)
        mk, main = st.marks, st.rows.main
        torch.bmm(q.unsqueeze(1), mk.k_scaled_t, out=mk.logits)
        torch.softmax(mk.logits, dim=-1, out=mk.probs)                      # s(q K~^T)
        torch.bmm(mk.probs, mk.z, out=mk.c)
        mk.c.div_(main.den.unsqueeze(1))
        return torch.bmm(mk.c, main.num).squeeze(1)                          # (B, d)

    def _update(self, st: ContinualNystromState, q, k, v, slot: int, full: bool) -> tuple[str, bool]:
        """Remove the departing key from the main rows, add the new key to every row, swap in
        the shadow rows after n keys. Returns (event, rescaled)."""
        rows, m = st.rows, self.m
        if full:   # the departing key leaves the main rows, with the scores it was added with
            remove_key(rows.main, st.key_scores[:, slot], st.ring.v[:, slot], rows.scratch_main)
        st.ring.write(slot, q, k, v)
        torch.bmm(rows.q_scaled, k.unsqueeze(-1), out=rows.new_scores)
        scores = rows.new_scores.squeeze(-1)                                   # (B, R)
        rescaled = add_key(rows.sums, scores, v, self.stabilize, rows.scratch)
        st.key_scores[:, slot].copy_(scores[:, :m])
        if rows.shadow is None:
            return "step", rescaled
        rows.shadow_keys += 1
        if rows.shadow_keys < self.n:
            return "step", rescaled
        rows.main.copy_(rows.shadow)     # the shadow holds exactly the window: no drift
        rows.shadow.clear_()
        rows.shadow_keys = 0
        return "swap", rescaled

    def _retroactive_output(self, st: ContinualNystromState, q: Tensor, slot: int, n_t: int) -> Tensor:
        mk = st.marks
        a = torch.softmax(torch.bmm(q.unsqueeze(1), mk.k_scaled_t), dim=-1)      # (B, 1, m')
        self.report.p_rebuilt = st.p is None
        if st.p is None:
            st.p = self._zeros(self._batch, self.n, mk.q.shape[1])
            st.p[:, :n_t] = torch.softmax(torch.matmul(st.ring.q[:, :n_t], mk.k_scaled_t), dim=-1)
        else:
            st.p[:, slot] = a[:, 0]
        zw = torch.bmm(mk.z, st.rows.main.output())                                 # (B, m, d)
        out = torch.bmm(st.p[:, :n_t], zw)                                          # (B, n_t, d)
        return out[:, window_order(st.t, self.n, q.device)]

    @inference
    def step_window(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Newest query over a recomputed window. q: (B, d), k, v: (B, n_t, d) -> (B, d)."""
        st = self._advance_window(q, k, v)
        changed = self.tracker.push(q, k[:, -1])
        report = StepReport(n_t=k.shape[1], warmup_landmarks=self.mode == "continual"
                            and not self.tracker.warm)
        if st.marks is None or (self.mode == "continual" and changed):
            st.marks = Landmarks.install(*self._source(), self.pinv_iters)
            report.event = "landmark"
        self.report = report
        mk = st.marks
        k1 = torch.softmax(torch.bmm(q.unsqueeze(1), mk.k_scaled_t), dim=-1)       # (B, 1, m)
        k3 = torch.softmax(torch.bmm(mk.q_scaled, k.transpose(1, 2)), dim=-1)      # (B, m, n_t)
        return torch.bmm(torch.bmm(k1, mk.z), torch.bmm(k3, v))[:, 0]

    # ------------------------------------------------------------------ cost
    def flops(self, r: StepReport) -> F.Flops:
        st = self.st
        m = st.marks.q.shape[1]
        if st.ring is None:
            return F.windowed_nystrom_sda(r.n_t, st.d, m, self.pinv_iters,
                                          landmark_update=r.event == "landmark",
                                          warmup_landmarks=r.warmup_landmarks)
        return F.continual_nystrom_sda(
            r.n_t, st.d, m, self.pinv_iters, event=r.event, retroactive=self.retroactive,
            evict=r.evicted, stabilize=self.stabilize, p_rebuilt=r.p_rebuilt,
            warmup_landmarks=r.warmup_landmarks, shadow=st.rows.shadow is not None,
            rescaled=r.rescaled)
