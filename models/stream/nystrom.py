"""Continual Nyström SDA (Carreto Picón et al.): s(q K~^T) s(Q~ K~^T)^+ s(Q~ K^T) V per token, the
step functions and their state.

The m rows of s(Q~ K^T) V are running sums (models/stream/sums.py), float64: a step removes the
departing key's term and adds the newest key's, O(m dh) per head. Landmarks are

- 'fixed': k-means centres from training (``Landmarks``, the same for every stream); only the rows
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
from .ops import F64, StateTensor, cast, filled, fresh, select, slot_of, write
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
REPLACED = ("key_scores", "ref", "den", "num", "peak", "q_scaled", "k_scaled_t", "z64")   # what a new landmark changes
FIXED_FIELDS = ("v_ring", "key_scores", "ref", "den", "num", "peak")   # what a fixed-landmark step reads
P_SPEC = "p"            # a retroactive block's cached s(q_i K~^T): (S, H, n, m) float32


class Landmarks(NamedTuple):
    """Installed landmarks: q_scaled (L, H, m, dh), k_scaled_t (L, H, dh, m) and their
    pseudo-inverse z (L, H, m, m) (float32 values, in float64 where it multiplies float64 sums);
    L = 1 for fixed landmarks, the same for every stream."""
    q_scaled: Tensor
    k_scaled_t: Tensor
    z: Tensor


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


def replaced(s: NystromState) -> tuple[Tensor, ...]:
    """The fields of ``s`` that a landmark's replacement changes (``REPLACED``)."""
    return tuple(getattr(s, name) for name in REPLACED)


def fixed_landmarks(q_land: Tensor, k_land: Tensor, iters: int) -> Landmarks:
    """``Landmarks`` (L = 1, contiguous) from a block's k-means landmarks (H, m, dh)."""
    return Landmarks(*(x.contiguous() for x in install(q_land.unsqueeze(0), k_land.unsqueeze(0), iters)))


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

class Token(NamedTuple):
    """The newest token of each stream: its position t (S,) and its q, k, v (S, H, dh)."""
    t: Tensor
    q: Tensor
    k: Tensor
    v: Tensor


class NystromStep(nn.Module):
    """One block's continual Nyström step for S streams, a function of its inputs: the module
    holds only constants (window n, m landmarks, ``mode`` 'fixed' with its ``fixed`` landmarks
    or 'continual', ``retroactive``, the stability measures, the pseudo-inverse).

    ``forward(s, p, x, events, known)`` -> (next state, next p, output, step events): s a
    NystromState; p (S, H, n, m) a retroactive block's cached s(q_i K~^T), else None; x the
    newest ``Token``; ``events`` how rare events branch (models/stream/ops.py); ``known`` what
    every stream of the call does, where the caller knows it from the positions
    (``landmark_event``): "steady", "replace", or None (any). The output is (S, H, dh), or when
    retroactive every slot's as the factors (p, Z num / den); step events (S, 4): rebuilt,
    replaced, rows refreshed, rescaled."""

    def __init__(self, n: int, m: int, iters: int, mode: str, *, fixed: Landmarks | None = None,
                 retroactive: bool = False, stability: Stability = Stability()):
        super().__init__()
        if mode == "fixed" and fixed is None:
            raise ValueError("a fixed-landmark step needs its landmarks")
        self.n, self.m, self.iters, self.mode = n, m, iters, mode
        self.retroactive, self.stability = retroactive, stability
        self.inverse = pinv                  # the landmarks' pseudo-inverse (ModelStep.use_inverse)
        self.register_buffer("slots", torch.arange(n))
        self.segments = Segments(n, m)
        if fixed is not None:
            self.register_buffer("fixed_q_scaled", fixed.q_scaled)
            self.register_buffer("fixed_k_scaled_t", fixed.k_scaled_t)
            self.register_buffer("fixed_z64", fixed.z)

    @property
    def fixed_marks(self) -> Landmarks:
        return Landmarks(self.fixed_q_scaled, self.fixed_k_scaled_t, self.fixed_z64)

    def forward(self, s: NystromState, p: Tensor | None, x: Token, events: str = "eager", known: str | None = None):
        s = NystromState(*fresh(x.t, list(s), events, inf=(REF,)))
        if p is not None:
            p = fresh(x.t, [p], events)[0]
        if self.mode == "fixed":
            return self._fixed(s, p, x, events)
        return self._continual(s, p, x, events, known)

    def _refresh(self, s: NystromState, valid: Tensor, events: str) -> tuple[NystromState, Tensor]:
        """Rows fallen to cancellation recomputed (``Stability.refresh``): the state and (S,)
        how many rows of each stream."""
        if not self.stability.refresh:
            return s, valid.new_zeros(valid.shape[0], dtype=I64)
        ref, den, num, peak, count = refresh(valid, s.key_scores, s.v_ring, s.ref, s.den, s.num, s.peak, events)
        return s._replace(ref=ref, den=den, num=num, peak=peak), count

    def _slide(self, s: NystromState, x: Token, here: Tensor, q_scaled: Tensor) -> tuple[NystromState, Tensor]:
        """The token into the rings; the departing key out of every row, the newest in (its
        scores against the query landmarks ``q_scaled``). Returns the state and (S,) whether a
        row was rescaled."""
        scores = torch.matmul(q_scaled, x.k.unsqueeze(-1)).squeeze(-1)                # (S, H, m)
        v_ring, key_scores, ref, den, num, peak, rescaled = slide(
            here, x.t >= self.n, scores, x.v, s.v_ring, s.key_scores, s.ref, s.den, s.num, s.peak,
            self.stability.rescale)
        return s._replace(q_ring=write(here, x.q, s.q_ring), k_ring=write(here, x.k, s.k_ring), v_ring=v_ring,
                          key_scores=key_scores, ref=ref, den=den, num=num, peak=peak), rescaled

    # -------------------------------------------------------------- fixed landmarks
    def _fixed(self, s: NystromState, p, x: Token, events: str):
        here, valid = slot_of(x.t, self.slots), filled(x.t, self.slots)
        q_scaled, k_scaled_t, z64 = self.fixed_marks
        s, rescaled = self._slide(s, x, here, q_scaled)
        s, refreshed = self._refresh(s, valid, events)
        zero = x.t.new_zeros(x.t.shape)
        flags = torch.stack([zero, zero, refreshed, rescaled.to(I64)], dim=1)
        if self.retroactive:
            p = write(here, query_rows(x.q.unsqueeze(2), k_scaled_t).squeeze(2), p)
            return s, p, (p, row_factors(z64, s.den, s.num, x.q.dtype)), flags
        return s, None, newest_output(x.q, k_scaled_t, z64, s.den, s.num), flags

    # -------------------------------------------------------------- continual landmarks
    def _continual(self, s: NystromState, p, x: Token, events: str, known: str | None):
        here = slot_of(x.t, self.slots)
        s, done = self.push(x.q, x.k, s)
        steady = (s.completed >= self.m) & ~(done & (s.completed == self.m))   # the m-th segment's step rebuilds
        operands = (s, p if p is not None else x.q.new_zeros(()), x, here, done)
        if known is not None:
            out = self.steady(*operands, events, known)
        else:
            out = select(steady, lambda *o: self.steady(*o, events, None), lambda *o: self.rebuilt(*o, events),
                         operands, events, returns=(NystromState, None, None, None, None))
        s, p_next, a, refreshed, rescaled = out
        flags = torch.stack([(~steady).to(I64), (steady & done).to(I64), refreshed, rescaled.to(I64)], dim=1)
        if self.retroactive:
            return s, p_next, (p_next, a), flags
        return s, None, a, flags

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

    def _output(self, s: NystromState, p, x: Token, here, changed, events: str, present=None):
        """The newest query's output, or (retroactive) every slot's factors with p kept: one
        new row, all rows where the landmarks ``changed`` (S,)."""
        if not self.retroactive:
            return newest_output(x.q, s.k_scaled_t, s.z64, s.den, s.num, present), p

        def all_rows(q_ring, k_scaled_t, p, q, here):
            return (query_rows(q_ring, k_scaled_t, present),)

        def one_row(q_ring, k_scaled_t, p, q, here):
            return (write(here, query_rows(q.unsqueeze(2), k_scaled_t, present).squeeze(2), p),)
        events = "masked" if events == "cond" else events            # (an If in an If costs the exporter)
        p, = select(changed, all_rows, one_row, (s.q_ring, s.k_scaled_t, p, x.q, here), events)
        return row_factors(s.z64, s.den, s.num, x.q.dtype), p

    def rebuilt(self, s: NystromState, p, x: Token, here, done, events: str):
        """The first n steps (and the m-th segment's): landmarks, pseudo-inverse and every row
        from scratch, from the segment means of the tokens seen (fewer than m: the others
        absent) or, once m segments completed, from the landmark slots. -> (state, p, output,
        rows refreshed, rescaled)."""
        t = x.t
        s = s._replace(q_ring=write(here, x.q, s.q_ring), k_ring=write(here, x.k, s.k_ring),
                       v_ring=write(here, x.v, s.v_ring))
        valid = filled(t, self.slots)
        means_q, present = self.segments.means(s.q_ring, t + 1)
        means_k, _ = self.segments.means(s.k_ring, t + 1)
        from_slots = (s.completed >= self.m).view(-1, 1, 1, 1)
        ql, kl = torch.where(from_slots, s.q_land, means_q), torch.where(from_slots, s.k_land, means_k)
        present = present | (s.completed >= self.m).view(-1, 1)
        q_scaled, k_scaled_t, z64 = install(ql, kl, self.iters, present, self.inverse)
        scores = torch.matmul(q_scaled, s.k_ring.transpose(-1, -2))                        # (S, H, m, n)
        ref, den, num = fresh_rows(scores, valid, s.v_ring, s.ref.dtype)
        s = s._replace(key_scores=scores.transpose(-1, -2), ref=ref, den=den, num=num, peak=den.clone(),
                       q_scaled=q_scaled, k_scaled_t=k_scaled_t, z64=z64)
        a, p = self._output(s, p, x, here, torch.ones_like(done), events, present)
        return s, p, a, t.new_zeros(t.shape), torch.zeros_like(done)

    def steady(self, s: NystromState, p, x: Token, here, done, events: str, known: str | None):
        """Past warm-up: slide the rows; where a segment completed, replace its landmark.
        -> (state, p, output, rows refreshed, rescaled)."""
        valid = filled(x.t, self.slots)
        s, rescaled = self._slide(s, x, here, s.q_scaled)
        if known == "replace":
            s = self.replace(s, valid)
        elif known != "steady":          # (only the fields a replacement changes pass the branch)
            fields = select(done, lambda s, valid: replaced(self.replace(s, valid)), lambda s, valid: replaced(s),
                            (s, valid), events)
            s = s._replace(**dict(zip(REPLACED, fields)))
        s, refreshed = self._refresh(s, valid, events)
        a, p = self._output(s, p, x, here, done, events)
        return s, p, a, refreshed, rescaled

    def replace(self, s: NystromState, valid: Tensor) -> NystromState:
        """The landmark of the segment just completed: a new pseudo-inverse, its row over the window."""
        q_scaled, k_scaled_t, z64 = install(s.q_land, s.k_land, self.iters, inverse=self.inverse)
        index = ((s.completed - 1) % self.m).view(-1, 1, 1, 1)
        mark = torch.gather(q_scaled, 2, index.expand(-1, q_scaled.shape[1], 1, q_scaled.shape[3]))   # (S, H, 1, dh)
        scores = torch.matmul(mark, s.k_ring.transpose(-1, -2))                                  # (S, H, 1, n)
        r, d, nm = fresh_rows(scores, valid, s.v_ring, s.ref.dtype)
        mine = (self.segments.marks.view(1, -1) == index.view(-1, 1)).unsqueeze(1)              # (S, 1, m)
        key_scores = torch.where(mine.unsqueeze(2) & valid.view(valid.shape[0], 1, -1, 1),
                                 scores.transpose(-1, -2), s.key_scores)
        return s._replace(key_scores=key_scores, ref=torch.where(mine, r, s.ref), den=torch.where(mine, d, s.den),
                          num=torch.where(mine.unsqueeze(-1), nm, s.num), peak=torch.where(mine, d, s.peak),
                          q_scaled=q_scaled, k_scaled_t=k_scaled_t, z64=z64)

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
