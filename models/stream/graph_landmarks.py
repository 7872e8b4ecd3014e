"""The explicit-state step of a continual Nyström model with continual landmarks (stream-aligned
segment means, models/landmarks.py), for ONNX export; the shared parts are in
models/stream/graph.py."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..landmarks import segment_sizes
from ..sda.reference import landmark_pinv
from .graph import (F64, SegmentMeans, StateTensor, StreamGraph, branch, dense, fresh_rows,
                           landmark_output, present_pinv, refresh, slide)


class ContinualNystromGraph(StreamGraph):
    """Continual Nyström SDA with continual landmarks: stream-aligned segment means
    (models/landmarks.py). Warm-up (t + 1 < n): everything from the partial window each step
    (fewer than m tokens: the absent landmarks padded, graph.present_pinv); the step that
    completes the m-th segment: rebuilt from the m landmark slots; then one landmark replaced
    every n/m steps (new pseudo-inverse, its row over the window)."""

    kind = "continual_nystrom/continual"
    # What the caller (models/stream/batch.py) knows of this step for every stream it steps, from
    # their positions alone: None, nothing (the events are selects or conds); "steady", past
    # warm-up (t >= n: the m-th segment completed at t = n - 1) and no segment completes; "replace",
    # past warm-up and a segment completes ((t + 1) mod n at a segment boundary, landmark_event).
    # The branches not taken are then not computed.
    known = None

    def __init__(self, model, block: int = 0):
        super().__init__(model, block)
        self.m, self.iters = self.attn.num_landmarks, self.attn.pinv_iters
        self.register_buffer("sizes", torch.tensor(segment_sizes(self.n, self.m)))
        self.register_buffer("marks", torch.arange(self.m))                    # (m,) landmark index
        self.warmup_means = SegmentMeans(self.n, self.m)

    def state_spec(self) -> list[StateTensor]:
        return self.spec(self.H, self.n, self.dh, self.m, self.retroactive)

    @staticmethod
    def spec(H: int, n: int, dh: int, m: int, retroactive: bool) -> list[StateTensor]:
        f32, i64 = torch.float32, torch.int64
        return [StateTensor("q_ring", (H, n, dh), f32), StateTensor("k_ring", (H, n, dh), f32),
                StateTensor("v_ring", (H, n, dh), f32), StateTensor("key_scores", (H, n, m), f32),
                StateTensor("ref", (H, m), F64), StateTensor("den", (H, m), F64),
                StateTensor("num", (H, m, dh), F64), StateTensor("peak", (H, m), F64),
                StateTensor("seg_q", (H, dh), f32), StateTensor("seg_k", (H, dh), f32),
                StateTensor("seg_count", (), i64), StateTensor("completed", (), i64),
                StateTensor("q_land", (H, m, dh), f32), StateTensor("k_land", (H, m, dh), f32),
                StateTensor("q_scaled", (H, m, dh), f32), StateTensor("k_scaled_t", (H, dh, m), f32),
                StateTensor("z64", (H, m, m), F64)]

    # -------------------------------------------------------------- landmarks
    def install(self, ql: Tensor, kl: Tensor, present: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Landmarks (H, m, dh) -> scaled q, scaled k transposed, pinv in float64 (rounded to
        float32 first, as the step keeps it); ``present`` (m,): the landmarks in use."""
        z = landmark_pinv(ql, kl, self.iters) if present is None else present_pinv(ql, kl, present, self.iters)
        return ql * self.scale, (kl * self.scale).transpose(1, 2), z.to(F64)

    def push(self, q, k, seg_q, seg_k, seg_count, completed, q_land, k_land):
        """The segment tracker (ContinualLandmarks.push): returns its state and whether this
        token completed a segment."""
        seg_q, seg_k, seg_count = seg_q + q, seg_k + k, seg_count + 1
        slot = completed % self.m
        size = torch.index_select(self.sizes, 0, slot.view(1)).squeeze(0)
        done = seg_count == size
        mark = (self.marks == slot).view(1, self.m, 1) & done
        q_land = torch.where(mark, (seg_q / size.to(seg_q.dtype)).unsqueeze(1), q_land)
        k_land = torch.where(mark, (seg_k / size.to(seg_k.dtype)).unsqueeze(1), k_land)
        zero = seg_q.new_zeros(())
        seg_q, seg_k = torch.where(done, zero, seg_q), torch.where(done, zero, seg_k)
        seg_count = torch.where(done, torch.zeros_like(seg_count), seg_count)
        return seg_q, seg_k, seg_count, completed + done.to(completed.dtype), q_land, k_land, done

    def rebuild(self, ql, kl, q, q_ring, k_ring, v_ring, n_t, present=None):
        """Landmarks, pseudo-inverse and every row from scratch over the window's n_t slots."""
        q_scaled, k_scaled_t, z64 = self.install(ql, kl, present)
        scores = torch.matmul(q_scaled, k_ring.transpose(1, 2))                         # (H, m, n)
        ref, den, num = fresh_rows(scores, self.slots < n_t, v_ring)
        a = landmark_output(self, q, q_ring, k_scaled_t, z64, den, num, present)
        return a, scores.transpose(1, 2), ref, den, num, den, q_scaled, k_scaled_t, z64

    # -------------------------------------------------------------- the step
    def attend(self, t, q, k, v, q_ring, k_ring, v_ring, key_scores, ref, den, num, peak, seg_q,
               seg_k, seg_count, completed, q_land, k_land, q_scaled, k_scaled_t, z64):
        state = self.fresh(t, [q_ring, k_ring, v_ring, key_scores, ref, den, num, peak, seg_q,
                               seg_k, seg_count, completed, q_land, k_land, q_scaled,
                               k_scaled_t, z64])
        (q_ring, k_ring, v_ring, key_scores, ref, den, num, peak, seg_q, seg_k, seg_count,
         completed, q_land, k_land, q_scaled, k_scaled_t, z64) = state
        here = self.slot_mask(t)
        seg_q, seg_k, seg_count, completed, q_land, k_land, done = self.push(
            q, k, seg_q, seg_k, seg_count, completed, q_land, k_land)
        n_t = torch.clamp(t + 1, max=self.n)
        warm = completed >= self.m
        just_warm = done & (completed == self.m)
        operands = (t, n_t, here, q, k, v, q_ring, k_ring, v_ring, key_scores, ref, den, num, peak,
                    q_land, k_land, q_scaled, k_scaled_t, z64, done, completed)
        steady = warm & ~just_warm
        if self.known is not None:
            out = self.steady(*operands)
        else:
            out = branch(steady, self.steady, self.rebuilt, operands, self.masked)
        a, q_ring, k_ring, v_ring, key_scores, ref, den, num, peak, q_scaled, k_scaled_t, z64, stale = out
        events = torch.stack([(~steady).to(torch.int64), (steady & done).to(torch.int64), stale])
        return (a, events, q_ring, k_ring, v_ring, key_scores, ref, den, num, peak,
                seg_q, seg_k, seg_count, completed, q_land, k_land, q_scaled, k_scaled_t, z64)

    def write(self, here, q, k, v, q_ring, k_ring, v_ring):
        mask = here.view(1, -1, 1)
        return (torch.where(mask, q.unsqueeze(1), q_ring), torch.where(mask, k.unsqueeze(1), k_ring),
                torch.where(mask, v.unsqueeze(1), v_ring))

    def rebuilt(self, t, n_t, here, q, k, v, q_ring, k_ring, v_ring, key_scores, ref, den, num,
                peak, q_land, k_land, q_scaled, k_scaled_t, z64, done, completed):
        """Warm-up, or the step that completes the m-th segment: everything from scratch. The two
        sources of landmarks are both computed and one selected (``masked``), also in the ONNX
        graph: only the first n steps of a stream take this branch, and an If nested in the
        step's If cost torch's exporter a quarter of its time (36 -> 28 s for the shipped model)."""
        q_ring, k_ring, v_ring = self.write(here, q, k, v, q_ring, k_ring, v_ring)
        operands = (t, n_t, q, q_ring, k_ring, v_ring, q_land, k_land, completed)
        out = branch(completed >= self.m, self.from_slots, self.from_window, operands, masked=True)
        return dense(out[0], q_ring, k_ring, v_ring, *out[1:], t.new_zeros(()))

    def from_slots(self, t, n_t, q, q_ring, k_ring, v_ring, q_land, k_land, completed):
        return dense(*self.rebuild(q_land, k_land, q, q_ring, k_ring, v_ring, n_t))

    def from_window(self, t, n_t, q, q_ring, k_ring, v_ring, q_land, k_land, completed):
        """Warm-up: the segment means of the t + 1 tokens seen, min(m, t + 1) of them; while
        fewer than m, the others are absent (present_pinv)."""
        (ql, present), (kl, _) = self.warmup_means(q_ring, n_t), self.warmup_means(k_ring, n_t)
        return dense(*self.rebuild(ql, kl, q, q_ring, k_ring, v_ring, n_t, present))

    def steady(self, t, n_t, here, q, k, v, q_ring, k_ring, v_ring, key_scores, ref, den, num,
               peak, q_land, k_land, q_scaled, k_scaled_t, z64, done, completed):
        """Past warm-up: slide the rows; on a completed segment, replace its landmark."""
        q_ring = torch.where(here.view(1, -1, 1), q.unsqueeze(1), q_ring)
        k_ring = torch.where(here.view(1, -1, 1), k.unsqueeze(1), k_ring)
        v_ring, key_scores, ref, den, num, peak = slide(
            here, t >= self.n, torch.matmul(q_scaled, k.unsqueeze(-1)).squeeze(-1), v,
            v_ring, key_scores, ref, den, num, peak)
        operands = (n_t, k_ring, v_ring, key_scores, ref, den, num, peak, q_land, k_land,
                    q_scaled, k_scaled_t, z64, completed)
        if self.known is None:
            replaced = branch(done, self.replace, self.unchanged, operands, self.masked)
        else:
            replaced = (self.replace if self.known == "replace" else self.unchanged)(*operands)
        key_scores, ref, den, num, peak, q_scaled, k_scaled_t, z64 = replaced
        ref, den, num, peak, stale = refresh(self.slots < n_t, key_scores, v_ring, ref, den, num, peak,
                                             masked=self.masked)
        a = landmark_output(self, q, q_ring, k_scaled_t, z64, den, num)
        return dense(a, q_ring, k_ring, v_ring, key_scores, ref, den, num, peak, q_scaled, k_scaled_t,
                     z64, stale)

    def replace(self, n_t, k_ring, v_ring, key_scores, ref, den, num, peak, q_land, k_land,
                q_scaled, k_scaled_t, z64, completed):
        """The landmark of the segment just completed: new pseudo-inverse, its row over the window."""
        q_scaled, k_scaled_t, z64 = self.install(q_land, k_land)
        row = (self.marks == (completed - 1) % self.m)                     # (m,)
        scores = torch.matmul(q_scaled, k_ring.transpose(1, 2))                      # (H, m, n)
        r, d, nm = fresh_rows(scores, self.slots < n_t, v_ring)
        key_scores = torch.where(row.view(1, 1, -1) & (self.slots < n_t).view(1, -1, 1),
                                 scores.transpose(1, 2), key_scores)
        row2 = row.view(1, -1)
        return dense(key_scores, torch.where(row2, r, ref), torch.where(row2, d, den),
                     torch.where(row2.unsqueeze(-1), nm, num), torch.where(row2, d, peak),
                     q_scaled, k_scaled_t, z64)

    def unchanged(self, n_t, k_ring, v_ring, key_scores, ref, den, num, peak, q_land, k_land,
                  q_scaled, k_scaled_t, z64, completed):
        return dense(key_scores, ref, den, num, peak, q_scaled, k_scaled_t, z64)


def landmark_event(t, n: int, m: int):
    """What a continual-landmark step at positions t (an int array) does, from the positions
    alone: 0 warm-up (t < n), 1 steady, 2 a segment completes and its landmark is replaced. The
    tracker (ContinualNystromGraph.push) completes segment j of each n tokens when (t + 1) mod n
    is the sum of the first j + 1 sizes (mod n)."""
    bounds = np.cumsum(segment_sizes(n, m)) % n
    t = np.asarray(t)
    return np.where(t < n, 0, np.where(np.isin((t + 1) % n, bounds), 2, 1))
