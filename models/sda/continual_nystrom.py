"""Continual Nyström SDA (Carreto Picón et al.): s(q K~^T) s(Q~ K~^T)^+ s(Q~ K^T) V per token.

The m rows of s(Q~ K^T) V are running sums (models/running_sums.py), kept in float64: each step
removes the departing key's term and adds the newest key's, O(m d). Landmarks are
  'continual'  stream-aligned segment means (models/landmarks.py): one replaced every n/m steps,
               with its pseudo-inverse and its row recomputed over the window; during warm-up
               (t < n) everything is rebuilt each step from the partial window's segment means;
  'fixed'      k-means centres from training: nothing but the rows changes. The float64 sums keep
               rows that are never recomputed from drifting, at no extra FLOPs.
A window-fed kernel (the single-output block after a retroactive one) gets a new window of keys
every step; its continual landmarks are the stream-aligned segment means of the current window's
queries and keys, which the caller passes in (models/mha.py), so it equals the batch forward.
A retroactive kernel with ``factored = True`` returns its n_t outputs as the factors
(s(Q K~^T), Z s(Q~ K^T) V) so that the caller can fold its out-projection into the m rows
(models/mha.py): n_t m D instead of n_t D^2 multiply-adds.
The steady step (no landmark change) allocates nothing but its output; with ``fused=True`` it is
one compiled call (models/fused/).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .. import flops as F
from ..landmarks import ContinualLandmarks
from ..running_sums import (TAU, RunningSums, SumsScratch, add_key, fresh_sums, refresh_stale,
                            remove_key)
from .fixed import check_fixed_dim, check_mode, expand_fixed, init_landmarks
from .kernel import Ring, SDAKernel, StepReport, StreamState, fused_kernels, window_order
from .reference import inference, landmark_pinv


@dataclass
class Landmarks:
    """The landmarks in use and what is derived from them; m' = min(m, t) during warm-up."""
    q: Tensor           # (B, m', d) query landmarks, unscaled
    k: Tensor           # (B, m', d) key landmarks, unscaled
    q_scaled: Tensor    # (B, m', d) q / sqrt(d)
    k_scaled_t: Tensor  # (B, d, m') (k / sqrt(d))^T, contiguous
    z: Tensor           # (B, m', m') pinv(s(Q~ K~^T))
    z64: Tensor         # (B, m', m') the same in float64 (it multiplies the float64 sums)
    logits: Tensor      # (B, 1, m') step buffers of the output s(q K~^T) Z / den @ num
    probs: Tensor       # (B, 1, m')
    probs64: Tensor     # (B, 1, m') float64
    c: Tensor           # (B, 1, m') float64

    @staticmethod
    def install(q: Tensor, k: Tensor, iters: int, fused: bool = False) -> "Landmarks":
        """Landmarks q, k (B, m', d) and their pseudo-inverse; ``fused``: the compiled
        pseudo-inverse (models/fused/pinv.py, same arithmetic), for float32 CPU landmarks."""
        s = 1.0 / math.sqrt(q.shape[-1])
        B, m = q.shape[:2]
        if fused:
            from ..fused.pinv import landmark_pinv as compiled_pinv
            z, z64 = compiled_pinv(q, k, iters)
        else:
            z = landmark_pinv(q, k, iters).contiguous()
            z64 = z.double()
        buf = lambda dtype=q.dtype: q.new_empty(B, 1, m, dtype=dtype)  # noqa: E731
        return Landmarks(q.clone(), k.clone(), (q * s).contiguous(),
                         (k * s).transpose(1, 2).contiguous(), z, z64,
                         buf(), buf(), buf(torch.float64), buf(torch.float64))


@dataclass
class LandmarkRows:
    """Running sums of s(Q~ K^T) V, one row per landmark (float64 unless stability is off)."""
    sums: RunningSums            # (B, m)
    q_scaled: Tensor             # (B, m, d) the scaled query landmark of every row
    new_scores: Tensor           # (B, m, 1) step buffer: the newest key against every row
    out: Tensor                  # (B, 1, d) step buffer of the output, in the sums' dtype
    scratch: SumsScratch         # step buffers for all rows


@dataclass
class ContinualNystromState(StreamState):
    ring: Ring | None = None             # queries, keys and values of the window
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
        self._arrays = None              # numpy views of the state for the fused step
        self._steady_report = StepReport(n_t=window, evicted=True)
        self.factored = False            # retroactive: return (p, zw), see _retroactive_output
        init_landmarks(self, num_landmarks, landmark_mode, fixed_landmarks, pinv_iters)

    def _new_state(self) -> ContinualNystromState:
        self._arrays = None
        return ContinualNystromState()

    def _allocate(self, d, device, dtype, window_input) -> None:
        B, n = self._batch, self.n
        if not window_input:
            self.st.ring = Ring(self._zeros(B, n, d), self._zeros(B, n, d), self._zeros(B, n, d))
            self.st.key_scores = self._zeros(B, n, self.m)
            self.tracker.reset(B, d, device, dtype, hist=(self.st.ring.q, self.st.ring.k))   # slot t = token t while t < n

    def _check_more(self, d: int) -> None:
        check_fixed_dim(self, d)

    def state_nbytes(self) -> int:
        return super().state_nbytes() + self.tracker.nbytes()

    # ------------------------------------------------------------------ landmarks
    def set_landmark_mode(self, mode: str, fixed_landmarks=None) -> None:
        """Switch landmark mode; allowed mid-stream (the next step uses the new landmarks).
        Fixed -> continual mid-stream: the segment sums are rebuilt from the stored window."""
        self.fixed = check_mode(self, mode, fixed_landmarks)
        changed = mode != self.mode or fixed_landmarks is not None
        resume = mode == "continual" and self.mode == "fixed"
        self.mode = mode
        st = self.st
        if changed and st is not None and st.t > 0:
            if st.ring is None:          # window-fed: reinstall on the next step
                st.marks = None
                return
            if resume:
                q, k, _ = st.ring.ordered(st.t)
                self.tracker.resume(q, k, st.t)
            self._rebuild(st)

    def landmarks(self) -> tuple[Tensor, Tensor] | None:
        """(q_land, k_land) (B, m', d) the last step used (oldest segment first), or None."""
        st = self.st
        if st is None or st.t == 0 or st.marks is None:
            return None
        if self.mode == "continual" and st.ring is not None:
            return self.tracker.chronological()
        return st.marks.q, st.marks.k

    def _source(self) -> tuple[Tensor, Tensor]:
        return expand_fixed(self) if self.mode == "fixed" else self.tracker.current()

    def _sums(self, scores: Tensor, values: Tensor) -> RunningSums:
        """Fresh row sums in the rows' dtype (float64 unless stability.wide is off)."""
        dt = torch.float64 if self.stability.wide else values.dtype
        return fresh_sums(scores.to(dt), values.to(dt))

    def _rebuild(self, st: ContinualNystromState) -> None:
        """Landmarks, pseudo-inverse and every row from scratch over the stored window."""
        self._arrays = None
        st.marks = Landmarks.install(*self._source(), self.pinv_iters, self._fusable())
        n_t, m = min(st.t, self.n), self.m
        scores = torch.matmul(st.marks.q_scaled, st.ring.k[:, :n_t].transpose(1, 2))   # (B, m', n_t)
        sums = self._sums(scores, st.ring.v[:, :n_t])
        if scores.shape[1] == m:
            st.key_scores[:, :n_t] = scores.transpose(1, 2)
        q_rows = st.marks.q_scaled
        R = q_rows.shape[1]
        st.rows = LandmarkRows(sums, q_rows, q_rows.new_empty(self._batch, R, 1),
                               sums.num.new_empty(self._batch, 1, st.d), SumsScratch.like(sums))
        st.p = None

    def _replace_landmark(self, st: ContinualNystromState, n_t: int) -> None:
        """A continual landmark replaced its slot: new pinv, its row over the window."""
        self._arrays = None
        r = (self.tracker.state.completed - 1) % self.m
        st.marks = Landmarks.install(*self.tracker.current(), self.pinv_iters, self._fusable())
        st.rows.q_scaled = st.marks.q_scaled
        row_scores = torch.bmm(st.ring.k[:, :n_t], st.marks.q_scaled[:, r].unsqueeze(-1)).squeeze(-1)
        st.rows.sums.assign_((slice(None), r), self._sums(row_scores.unsqueeze(1), st.ring.v[:, :n_t]))
        st.key_scores[:, :n_t, r] = row_scores
        st.p = None

    # ------------------------------------------------------------------ stepping
    def steady_next(self) -> bool:
        """Whether the next step changes no landmark (the fused kernel can take it)."""
        st = self.st
        if st is None or st.rows is None or self.retroactive or st.rows.sums.num.dtype != torch.float64:
            return False
        return self.mode == "fixed" or not self.tracker.completes_next()

    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """q, k, v: (B, d) -> (B, d) single-output, or (B, n_t, d) retroactive, or the factors
        ((B, n_t, m'), (B, m', d)) of that output when ``factored``."""
        if self._fusable() and self.steady_next():
            arrays = self._as_arrays(q, k, v)
            if arrays is not None:
                return self._fused_step(*arrays)
        return self._step(q, k, v)

    @inference
    def _step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._arrays = None
        st, slot, full, n_t = self._advance(q, k, v)
        fixed = self.mode == "fixed"
        changed = False if fixed else self.tracker.push(q, k)
        warmup = not fixed and not self.tracker.warm
        just_warm = not fixed and changed and self.tracker.state.completed == self.m
        report = StepReport(n_t=n_t, evicted=full, warmup_landmarks=warmup)
        if st.rows is None or warmup or just_warm:
            # first step, or warm-up with continual landmarks: the landmarks change every step
            st.ring.write(slot, q, k, v)
            self._rebuild(st)
            report.event, report.evicted = "rebuild", False
        else:
            report.rescaled = self._update(st, q, k, v, slot, full)
            if not fixed and changed:
                self._replace_landmark(st, n_t)
                report.event = "landmark"
            if self.stability.refresh:
                report.rows_refreshed = refresh_stale(
                    st.rows.sums, lambda b, r: st.key_scores[b, :n_t, r], st.ring.v, n_t,
                    st.rows.scratch)
        self.report = report
        if self.retroactive:
            return self._retroactive_output(st, q, slot, n_t)
        mk, rows = st.marks, st.rows
        torch.bmm(q.unsqueeze(1), mk.k_scaled_t, out=mk.logits)
        torch.softmax(mk.logits, dim=-1, out=mk.probs)                      # s(q K~^T)
        z = mk.z64 if rows.out.dtype == torch.float64 else mk.z
        probs = mk.probs64.copy_(mk.probs) if z is mk.z64 else mk.probs
        c = mk.c if z is mk.z64 else mk.logits
        torch.bmm(probs, z, out=c)
        c.div_(rows.sums.den.unsqueeze(1))
        torch.bmm(c, rows.sums.num, out=rows.out)
        return rows.out.squeeze(1).to(q.dtype, copy=True)                    # (B, d)

    def _update(self, st: ContinualNystromState, q, k, v, slot: int, full: bool) -> bool:
        """Remove the departing key from the rows, add the new key. Returns whether a row was
        rescaled."""
        rows = st.rows
        if full:   # the departing key leaves the rows, with the scores it was added with
            remove_key(rows.sums, st.key_scores[:, slot], st.ring.v[:, slot], rows.scratch)
        st.ring.write(slot, q, k, v)
        torch.bmm(rows.q_scaled, k.unsqueeze(-1), out=rows.new_scores)
        scores = rows.new_scores.squeeze(-1)                                   # (B, m)
        rescaled = add_key(rows.sums, scores, v, self.stability.rescale, rows.scratch)
        st.key_scores[:, slot].copy_(scores)
        return rescaled

    def _fused_step(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Tensor:
        """The steady step in one compiled call (models/fused/kernels.nystrom_step)."""
        out = np.empty(q.shape, np.float32)
        slot, full, n_t, track = self.fused_begin()
        a, stab = self.fused_arrays(), self.stability
        flags = fused_kernels().nystrom_step(q, k, v, a[0], a[1], a[2], a[3], a[4], a[5],
                             a[6], a[7], a[8], a[9], a[10], a[11], a[12], slot, full, n_t, track,
                             stab.rescale, stab.refresh, TAU, a[13], out)
        self.fused_end(*flags)
        return torch.from_numpy(out)

    def fused_begin(self) -> tuple[int, bool, int, bool]:
        """Count a steady token (see ``steady_next``): (ring slot, window was full, n_t, whether the
        segment sums take it)."""
        st = self.st
        slot, full = st.t % self.n, st.t >= self.n
        st.t += 1
        track = self.mode == "continual"
        if track:
            self.tracker.count()
        return slot, full, min(st.t, self.n), track

    def fused_end(self, rescaled: bool, refreshed: int) -> None:
        """Record what a fused step did (the common full-window step shares one record)."""
        t, n = self.st.t, self.n
        if t > n and not rescaled and not refreshed:
            self.report = self._steady_report
        else:
            self.report = StepReport(n_t=min(t, n), evicted=t > n, rescaled=bool(rescaled),
                                     rows_refreshed=int(refreshed))

    def fused_arrays(self) -> tuple:
        """Numpy views of the state for models/fused/kernels.nystrom_step (cached until a torch
        step replaces a tensor)."""
        if self._arrays is None:
            st, tr, mk, sums = self.st, self.tracker.state, self.st.marks, self.st.rows.sums
            views = [st.ring.q, st.ring.k, st.ring.v, st.key_scores, sums.ref, sums.den, sums.num,
                     sums.peak, mk.q_scaled, mk.k_scaled_t, mk.z, tr.seg_q, tr.seg_k]
            self._arrays = tuple(x.numpy() for x in views) + (np.empty((3, self.m)),)
            assert all(a.flags.c_contiguous for a in self._arrays)
        return self._arrays

    def _retroactive_output(self, st: ContinualNystromState, q: Tensor, slot: int, n_t: int):
        """Every window slot's output P (Z num / den), window order: (B, n_t, d), or with
        ``factored`` the pair P (B, n_t, m'), Z num / den (B, m', d)."""
        mk = st.marks
        a = torch.softmax(torch.bmm(q.unsqueeze(1), mk.k_scaled_t), dim=-1)      # (B, 1, m')
        self.report.p_rebuilt = st.p is None
        if st.p is None:
            st.p = self._zeros(self._batch, self.n, mk.q.shape[1])
            st.p[:, :n_t] = torch.softmax(torch.matmul(st.ring.q[:, :n_t], mk.k_scaled_t), dim=-1)
        else:
            st.p[:, slot] = a[:, 0]
        z = mk.z64 if st.rows.sums.num.dtype == torch.float64 else mk.z
        zw = torch.bmm(z, st.rows.sums.output()).to(q.dtype)                      # (B, m, d)
        p = st.p[:, :n_t][:, window_order(st.t, self.n, q.device)]                 # (B, n_t, m)
        return (p, zw) if self.factored else torch.bmm(p, zw)                      # (B, n_t, d)

    @inference
    def step_window(self, q: Tensor, kv, landmarks: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Newest query over a recomputed window. q: (B, d), kv: KeyValues / FoldedKeyValues
        (models/sda/window.py) of (B, n_t, d) keys and values -> (B, d).

        ``landmarks``: (q_land, k_land) (B, m', d), needed with continual landmarks: the
        stream-aligned segment means of the window's queries and keys (models/landmarks.
        aligned_means), new every step because the window itself is recomputed."""
        st = self._advance_window(q, kv)
        n_t, continual = kv.n_t, self.mode == "continual"
        report = StepReport(n_t=n_t, warmup_landmarks=continual and st.t < self.n)
        if continual:
            if landmarks is None:
                raise ValueError("step_window with continual landmarks needs landmarks=(q_land, "
                                 "k_land): the aligned segment means of the window")
            st.marks = Landmarks.install(*landmarks, self.pinv_iters, self._fusable())
            report.event = "window"
        elif st.marks is None:
            st.marks = Landmarks.install(*self._source(), self.pinv_iters, self._fusable())
            report.event = "landmark"
        self.report = report
        mk = st.marks
        k1 = torch.softmax(torch.bmm(q.unsqueeze(1), mk.k_scaled_t), dim=-1)       # (B, 1, m)
        k3 = torch.softmax(kv.scores(mk.q_scaled), dim=-1)                        # (B, m, n_t)
        return torch.bmm(torch.bmm(k1, mk.z), kv.mix(k3))[:, 0]

    # ------------------------------------------------------------------ cost
    def flops(self, r: StepReport) -> F.Flops:
        st = self.st
        m = st.marks.q.shape[1]
        if st.ring is None:
            return F.windowed_nystrom_sda(r.n_t, st.d, m, self.pinv_iters,
                                          landmark_update=r.event in ("landmark", "window"))
        return F.continual_nystrom_sda(
            r.n_t, st.d, m, self.pinv_iters, event=r.event,
            retroactive="factored" if self.retroactive and self.factored else self.retroactive,
            evict=r.evicted, stabilize=self.stability.refresh, p_rebuilt=r.p_rebuilt,
            warmup_landmarks=r.warmup_landmarks, segment_sums=self.mode == "continual",
            rescaled=r.rescaled)
