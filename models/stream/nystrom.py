"""Continual Nyström SDA (Carreto Picón et al.): s(q K~^T) s(Q~ K~^T)^+ s(Q~ K^T) V per token, the
step functions and their state.

The m rows of s(Q~ K^T) V are running sums (models/stream/sums.py), float64: a step removes the
departing key's term and adds the newest key's, O(m dh) per head. Landmarks are

- 'fixed': k-means centres from training (``Fixed``, the same for every stream); only the rows
  change, and a step costs O(m dh) whatever n;
- 'continual': stream-aligned segment means (models/landmarks.py): the segment sums of q and k
  are part of the state, and when a segment completes its mean replaces the landmark of the
  segment m places earlier, with a new pseudo-inverse and its row over the window. While the
  window fills (the first n tokens) everything is rebuilt each step from the partial window's
  segment means (the batch ``nystrom`` reference on that window); fewer than m tokens give
  fewer landmarks, the absent ones padded (``install``).

A retroactive block (the first of two) returns every window slot's output as two factors,
s(q_i K~^T) for every query (``p``, cached: one new row a step unless the landmarks change) and
Z num / den (m rows), so that the out-projection folds into the m rows (models/stream/model.py).

Shapes: S streams, H heads, n the window, m landmarks, dh the head width; q, k, v (S, H, dh);
t (S,) positions. The state keeps the window's queries and keys in both modes, so that a live
switch of landmark mode (``rows_from_scratch``, segments.resume) is a function of the state alone.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..sda.reference import pinv
from .ops import F64, StateTensor, cast, dense, filled, fresh, select, slot_of, write
from .segments import Segments, resume
from .sums import Stability, fresh_rows, refresh, slide

F32, I64 = torch.float32, torch.int64


class NystromState(NamedTuple):
    q_ring: Tensor        # (S, H, n, dh)
    k_ring: Tensor        # (S, H, n, dh)
    v_ring: Tensor        # (S, H, n, dh)
    key_scores: Tensor    # (S, H, n, m) each key slot's scaled scores against the query landmarks
    ref: Tensor           # (S, H, m) float64 (float32 without Stability.wide)
    den: Tensor           # (S, H, m)
    num: Tensor           # (S, H, m, dh)
    peak: Tensor          # (S, H, m)
    seg_q: Tensor         # (S, H, dh) sums of the segment in progress (continual landmarks)
    seg_k: Tensor         # (S, H, dh)
    seg_count: Tensor     # (S,) int64 its tokens
    completed: Tensor     # (S,) int64 segments completed
    q_land: Tensor        # (S, H, m, dh) landmark slots (slot = segment index % m)
    k_land: Tensor        # (S, H, m, dh)
    q_scaled: Tensor      # (S, H, m, dh) the landmarks in use, q / sqrt(dh)
    k_scaled_t: Tensor    # (S, H, dh, m) (k / sqrt(dh))^T
    z64: Tensor           # (S, H, m, m) their pseudo-inverse (float32 values) in float64

    @staticmethod
    def spec(H: int, n: int, dh: int, m: int, wide: bool = True) -> list[StateTensor]:
        rows = F64 if wide else F32
        shapes = {"key_scores": ((H, n, m), F32), "ref": ((H, m), rows), "den": ((H, m), rows),
                  "num": ((H, m, dh), rows), "peak": ((H, m), rows), "seg_q": ((H, dh), F32),
                  "seg_k": ((H, dh), F32), "seg_count": ((), I64), "completed": ((), I64),
                  "q_land": ((H, m, dh), F32), "k_land": ((H, m, dh), F32), "q_scaled": ((H, m, dh), F32),
                  "k_scaled_t": ((H, dh, m), F32), "z64": ((H, m, m), F64)}
        return [StateTensor(name, *shapes.get(name, ((H, n, dh), F32))) for name in NystromState._fields]


REF = NystromState._fields.index("ref")
FIXED_FIELDS = ("v_ring", "key_scores", "ref", "den", "num", "peak")   # what a fixed-landmark step reads
P_SPEC = "p"            # a retroactive block's cached s(q_i K~^T): (S, H, n, m) float32


class Fixed(NamedTuple):
    """Fixed landmarks, the same for every stream: (1, H, m, dh), (1, H, dh, m), (1, H, m, m)."""
    q_scaled: Tensor
    k_scaled_t: Tensor
    z64: Tensor


# ----------------------------------------------------------------------------- landmarks

def install(ql: Tensor, kl: Tensor, iters: int, present: Tensor | None = None,
            inverse=pinv) -> tuple[Tensor, Tensor, Tensor]:
    """Landmarks (S, H, m, dh) -> scaled q, scaled k transposed and the pseudo-inverse of
    s(Q~ K~^T / sqrt(dh)), formed and iterated in float64 (its rounding is what the inverse
    amplifies), rounded to float32 and kept in float64. ``present`` (S, m): the landmarks in use;
    the absent ones' columns are masked and their rows the identity's: pinv(blockdiag(A, I)) is
    blockdiag(pinv(A), I) through the same iteration on A (its scaling takes A's norms: A's rows
    sum to 1, its largest column sum is >= 1), with exact zeros off the block, so an output whose
    softmax over landmarks masks the absent ones equals the one with the present ones alone.
    ``inverse``: reference.pinv, or the same arithmetic compiled (models/fused/pinv.pinv64)."""
    scale = 1.0 / math.sqrt(ql.shape[-1])
    logits = torch.matmul(ql.to(F64) * scale, kl.to(F64).transpose(-1, -2))          # (S, H, m, m)
    if present is not None:
        logits = logits.masked_fill(~present.view(present.shape[0], 1, 1, -1), float("-inf"))
    kernel = torch.softmax(logits, dim=-1)
    if present is not None:
        eye = torch.eye(ql.shape[-2], dtype=F64, device=ql.device)
        kernel = torch.where(present.view(present.shape[0], 1, -1, 1), kernel, eye)
    z = inverse(kernel.contiguous(), iters).to(ql.dtype)
    return ql * scale, (kl * scale).transpose(-1, -2), z.to(F64)


def fixed_landmarks(q_land: Tensor, k_land: Tensor, iters: int) -> Fixed:
    """``Fixed`` from a block's k-means landmarks (H, m, dh)."""
    return Fixed(*install(q_land.unsqueeze(0), k_land.unsqueeze(0), iters))


# ----------------------------------------------------------------------------- outputs

def masked(logits: Tensor, present: Tensor | None) -> Tensor:
    """-inf in the columns of absent landmarks (present (S, m), or None: all present)."""
    return logits if present is None else logits.masked_fill(~present.view(present.shape[0], 1, 1, -1), float("-inf"))


def newest_output(q: Tensor, k_scaled_t: Tensor, z64: Tensor, den: Tensor, num: Tensor,
                  present: Tensor | None = None) -> Tensor:
    """s(q K~^T) Z num / den for the newest query: (S, H, dh) in q's dtype."""
    probs = torch.softmax(masked(torch.matmul(q.unsqueeze(2), k_scaled_t), present), dim=-1)   # (S, H, 1, m)
    c = torch.matmul(cast(probs, num.dtype), cast(z64, num.dtype)) / den.unsqueeze(2)
    return cast(torch.matmul(c, num).squeeze(2), q.dtype)


def row_factors(z64: Tensor, den: Tensor, num: Tensor, dtype) -> Tensor:
    """Z (num / den): (S, H, m, dh), the m rows every query of a retroactive block mixes."""
    return cast(torch.matmul(cast(z64, num.dtype), num / den.unsqueeze(-1)), dtype)


def query_rows(q_ring: Tensor, k_scaled_t: Tensor, present: Tensor | None = None) -> Tensor:
    """s(q_i K~^T) of every ring slot's query: (S, H, n, m)."""
    return torch.softmax(masked(torch.matmul(q_ring, k_scaled_t), present), dim=-1)


# ----------------------------------------------------------------------------- the steps

class NystromStep(nn.Module):
    """One block's continual Nyström step for S streams: ``forward(t, q, k, v, state, p)`` ->
    (output, next state, next p, events). ``mode`` 'fixed' (with ``fixed``: ``Fixed``) or
    'continual'; ``retroactive``: the output is every slot's as the factors (p, Z num / den),
    and ``p`` (S, H, n, m) is state, else None. ``events``: how rare events branch
    (models/stream/ops.py). ``known``: what every stream of the call does, set by a caller that
    knows it from the positions (``landmark_event``): "steady", "replace", or None (any)."""

    def __init__(self, n: int, m: int, iters: int, mode: str, *, fixed: Fixed | None = None,
                 retroactive: bool = False, events: str = "eager", stability: Stability = Stability()):
        super().__init__()
        if mode == "fixed" and fixed is None:
            raise ValueError("a fixed-landmark step needs its landmarks")
        self.n, self.m, self.iters, self.mode = n, m, iters, mode
        self.retroactive, self.events, self.stability = retroactive, events, stability
        self.known: str | None = None
        self.inverse = pinv                  # the landmarks' pseudo-inverse (ModelStep.use_inverse)
        self.register_buffer("slots", torch.arange(n))
        self.segments = Segments(n, m)
        self.fixed = None
        if fixed is not None:
            self.register_buffer("fixed_q_scaled", fixed.q_scaled)
            self.register_buffer("fixed_k_scaled_t", fixed.k_scaled_t)
            self.register_buffer("fixed_z64", fixed.z64)
            self.fixed = True

    def _dense(self, *xs: Tensor) -> tuple[Tensor, ...]:
        """A branch's outputs: ``ops.dense`` where the branch is a torch.cond, else as they are."""
        return dense(*xs) if self.events == "cond" else xs

    @property
    def fixed_marks(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.fixed_q_scaled, self.fixed_k_scaled_t, self.fixed_z64

    def forward(self, t: Tensor, q: Tensor, k: Tensor, v: Tensor, state: NystromState, p: Tensor | None):
        """-> (output (S, H, dh), or the factors ((S, H, n, m), (S, H, m, dh)) when retroactive;
        the next state; the next p; events (S, 4): rebuilt, replaced, rows refreshed, rescaled)."""
        s = NystromState(*fresh(t, list(state), self.events, inf=(REF,)))
        if p is not None:
            p = fresh(t, [p], self.events)[0]
        if self.mode == "fixed":
            return self._fixed(t, q, k, v, s, p)
        return self._continual(t, q, k, v, s, p)

    # -------------------------------------------------------------- fixed landmarks
    def _fixed(self, t, q, k, v, s: NystromState, p):
        here, valid = slot_of(t, self.slots), filled(t, self.slots)
        q_scaled, k_scaled_t, z64 = self.fixed_marks
        q_ring, k_ring = write(here, q, s.q_ring), write(here, k, s.k_ring)
        scores = torch.matmul(q_scaled, k.unsqueeze(-1)).squeeze(-1)                  # (S, H, m)
        v_ring, key_scores, ref, den, num, peak, rescaled = slide(
            here, t >= self.n, scores, v, s.v_ring, s.key_scores, s.ref, s.den, s.num, s.peak,
            self.stability.rescale)
        ref, den, num, peak, refreshed = self._refresh(valid, key_scores, v_ring, ref, den, num, peak)
        s = s._replace(q_ring=q_ring, k_ring=k_ring, v_ring=v_ring, key_scores=key_scores, ref=ref,
                       den=den, num=num, peak=peak)
        zero = t.new_zeros(t.shape)
        events = torch.stack([zero, zero, refreshed, rescaled.to(I64)], dim=1)
        if self.retroactive:
            p = write(here, query_rows(q.unsqueeze(2), k_scaled_t).squeeze(2), p)
            return (p, row_factors(z64, den, num, q.dtype)), s, p, events
        return newest_output(q, k_scaled_t, z64, den, num), s, None, events

    def _refresh(self, valid, key_scores, v_ring, ref, den, num, peak):
        if not self.stability.refresh:
            return ref, den, num, peak, valid.new_zeros(valid.shape[0], dtype=I64)
        return refresh(valid, key_scores, v_ring, ref, den, num, peak, self.events)

    # -------------------------------------------------------------- continual landmarks
    def _continual(self, t, q, k, v, s: NystromState, p):
        here = slot_of(t, self.slots)
        s, done = self.push(q, k, s)
        warm = s.completed >= self.m
        steady = warm & ~(done & (s.completed == self.m))       # the m-th segment's step rebuilds
        operands = (t, here, q, k, v, *s, done, p if p is not None else q.new_zeros(()))
        if self.known is not None:
            out = self.steady(*operands)
        else:
            out = select(steady, self.steady, self.rebuilt, operands, self.events)
        a, *fields, p_next, refreshed, rescaled = out
        s = NystromState(*fields)
        events = torch.stack([(~steady).to(I64), (steady & done).to(I64), refreshed, rescaled.to(I64)], dim=1)
        if self.retroactive:
            return (p_next, a), s, p_next, events
        return a, s, None, events

    def push(self, q, k, s: NystromState) -> tuple[NystromState, Tensor]:
        """The segment sums take the token; a completed segment's means fill its landmark slot.
        Returns the state and (S,) whether a segment completed."""
        seg_q, seg_k, count = s.seg_q + q, s.seg_k + k, s.seg_count + 1
        slot = s.completed % self.m
        size = self.segments.sizes[slot]                                             # (S,)
        done = count == size
        mark = ((self.segments.marks.view(1, -1) == slot.view(-1, 1)) & done.view(-1, 1)).view(-1, 1, self.m, 1)
        divisor = size.to(q.dtype).view(-1, 1, 1)
        q_land = torch.where(mark, (seg_q / divisor).unsqueeze(2), s.q_land)
        k_land = torch.where(mark, (seg_k / divisor).unsqueeze(2), s.k_land)
        zero = seg_q.new_zeros(())
        ended = done.view(-1, 1, 1)
        s = s._replace(seg_q=torch.where(ended, zero, seg_q), seg_k=torch.where(ended, zero, seg_k),
                       seg_count=torch.where(done, torch.zeros_like(count), count),
                       completed=s.completed + done.to(I64), q_land=q_land, k_land=k_land)
        return s, done

    def _output(self, q, q_ring, p, here, k_scaled_t, z64, den, num, changed, present=None):
        """The newest query's output, or (retroactive) every slot's factors with p kept: one
        new row, all rows where the landmarks ``changed`` (S,)."""
        if not self.retroactive:
            return newest_output(q, k_scaled_t, z64, den, num, present), p

        def all_rows(q_ring, k_scaled_t, p, q, here):
            return self._dense(query_rows(q_ring, k_scaled_t, present))

        def one_row(q_ring, k_scaled_t, p, q, here):
            return self._dense(write(here, query_rows(q.unsqueeze(2), k_scaled_t, present).squeeze(2), p))
        events = "masked" if self.events == "cond" else self.events      # (an If in an If costs the exporter)
        p, = select(changed, all_rows, one_row, (q_ring, k_scaled_t, p, q, here), events)
        return row_factors(z64, den, num, q.dtype), p

    def rebuilt(self, t, here, q, k, v, *rest):
        """The first n steps (and the m-th segment's): landmarks, pseudo-inverse and every row
        from scratch, from the segment means of the tokens seen (fewer than m: the others
        absent) or, once m segments completed, from the landmark slots."""
        s, done, p = NystromState(*rest[:17]), rest[17], rest[18]
        q_ring, k_ring, v_ring = write(here, q, s.q_ring), write(here, k, s.k_ring), write(here, v, s.v_ring)
        valid = filled(t, self.slots)
        means_q, present = self.segments.means(q_ring, t + 1)
        means_k, _ = self.segments.means(k_ring, t + 1)
        from_slots = (s.completed >= self.m).view(-1, 1, 1, 1)
        ql, kl = torch.where(from_slots, s.q_land, means_q), torch.where(from_slots, s.k_land, means_k)
        present = present | (s.completed >= self.m).view(-1, 1)
        q_scaled, k_scaled_t, z64 = install(ql, kl, self.iters, present, self.inverse)
        scores = torch.matmul(q_scaled, k_ring.transpose(-1, -2))                          # (S, H, m, n)
        ref, den, num = fresh_rows(scores, valid, v_ring, s.ref.dtype)
        a, p = self._output(q, q_ring, p, here, k_scaled_t, z64, den, num,
                            torch.ones_like(done), present)
        zero = t.new_zeros(t.shape)
        return self._dense(a, q_ring, k_ring, v_ring, scores.transpose(-1, -2), ref, den, num, den.clone(), s.seg_q, s.seg_k,
                     s.seg_count, s.completed, s.q_land, s.k_land, q_scaled, k_scaled_t, z64, p, zero,
                     torch.zeros_like(done))

    def steady(self, t, here, q, k, v, *rest):
        """Past warm-up: slide the rows; where a segment completed, replace its landmark."""
        s, done, p = NystromState(*rest[:17]), rest[17], rest[18]
        valid = filled(t, self.slots)
        q_ring, k_ring = write(here, q, s.q_ring), write(here, k, s.k_ring)
        scores = torch.matmul(s.q_scaled, k.unsqueeze(-1)).squeeze(-1)
        v_ring, key_scores, ref, den, num, peak, rescaled = slide(
            here, t >= self.n, scores, v, s.v_ring, s.key_scores, s.ref, s.den, s.num, s.peak,
            self.stability.rescale)
        operands = (valid, k_ring, v_ring, key_scores, ref, den, num, peak, s.q_land, s.k_land, s.q_scaled,
                    s.k_scaled_t, s.z64, s.completed)
        if self.known == "replace":
            replaced = self.replace(*operands)
        elif self.known == "steady":
            replaced = self.unchanged(*operands)
        else:
            replaced = select(done, self.replace, self.unchanged, operands, self.events)
        key_scores, ref, den, num, peak, q_scaled, k_scaled_t, z64 = replaced
        ref, den, num, peak, refreshed = self._refresh(valid, key_scores, v_ring, ref, den, num, peak)
        a, p = self._output(q, q_ring, p, here, k_scaled_t, z64, den, num, done)
        return self._dense(a, q_ring, k_ring, v_ring, key_scores, ref, den, num, peak, s.seg_q, s.seg_k, s.seg_count,
                     s.completed, s.q_land, s.k_land, q_scaled, k_scaled_t, z64, p, refreshed, rescaled)

    def replace(self, valid, k_ring, v_ring, key_scores, ref, den, num, peak, q_land, k_land, q_scaled,
                k_scaled_t, z64, completed):
        """The landmark of the segment just completed: a new pseudo-inverse, its row over the window."""
        q_scaled, k_scaled_t, z64 = install(q_land, k_land, self.iters, inverse=self.inverse)
        index = ((completed - 1) % self.m).view(-1, 1, 1, 1)
        mark = torch.gather(q_scaled, 2, index.expand(-1, q_scaled.shape[1], 1, q_scaled.shape[3]))   # (S, H, 1, dh)
        scores = torch.matmul(mark, k_ring.transpose(-1, -2))                                    # (S, H, 1, n)
        r, d, nm = fresh_rows(scores, valid, v_ring, ref.dtype)
        mine = (self.segments.marks.view(1, -1) == index.view(-1, 1)).unsqueeze(1)              # (S, 1, m)
        key_scores = torch.where(mine.unsqueeze(2) & valid.view(valid.shape[0], 1, -1, 1),
                                 scores.transpose(-1, -2), key_scores)
        return self._dense(key_scores, torch.where(mine, r, ref), torch.where(mine, d, den),
                     torch.where(mine.unsqueeze(-1), nm, num), torch.where(mine, d, peak),
                     q_scaled, k_scaled_t, z64)

    def unchanged(self, valid, k_ring, v_ring, key_scores, ref, den, num, peak, q_land, k_land, q_scaled,
                  k_scaled_t, z64, completed):
        return self._dense(key_scores, ref, den, num, peak, q_scaled, k_scaled_t, z64)

    # -------------------------------------------------------------- a live switch of mode
    def resumed(self, s: NystromState, seen: Tensor) -> NystromState:
        """The continual-landmark state after ``seen`` (S,) tokens, rebuilt from the window
        (segments.resume), its landmarks installed; rows: ``rows_from_scratch``."""
        s, ql, kl, present = resume(s, seen, self.n, self.m)
        q_scaled, k_scaled_t, z64 = install(ql, kl, self.iters, present, self.inverse)
        return s._replace(q_scaled=q_scaled, k_scaled_t=k_scaled_t, z64=z64)

    def rows_from_scratch(self, t: Tensor, s: NystromState, p: Tensor | None, marks) -> tuple[NystromState, Tensor | None]:
        """Key scores, rows (and p) over each stream's window for the landmarks ``marks``
        (q_scaled, k_scaled_t, z64) after t (S,) tokens seen (streams with t = 0 are left as
        they are: they start afresh)."""
        valid = self.slots.view(1, -1) < torch.clamp(t, max=self.n).view(-1, 1)
        q_scaled, k_scaled_t, z64 = (x.expand(t.shape[0], *x.shape[1:]) for x in marks)
        scores = torch.matmul(q_scaled, s.k_ring.transpose(-1, -2))
        ref, den, num = fresh_rows(scores, valid, s.v_ring, s.ref.dtype)
        s = s._replace(key_scores=scores.transpose(-1, -2).contiguous(), ref=ref, den=den, num=num, peak=den.clone(),
                       q_scaled=q_scaled.contiguous(), k_scaled_t=k_scaled_t.contiguous(), z64=z64.contiguous())
        if p is not None:
            p = query_rows(s.q_ring, k_scaled_t)
        return s, p
