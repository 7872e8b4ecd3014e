"""Numerically stable sliding-window softmax sums (the continual part of attention).

For a set of R "rows" (retroactive queries, or Nyström query landmarks) we keep, per row r,

    num[r] = sum_j exp(s_rj - ref[r]) * v_j          (d,)
    den[r] = sum_j exp(s_rj - ref[r])                ()

over the keys j of the current window, so that ``num / den`` is the softmax-weighted value.

Why this is stable where the published continual attention is not:
  * ``ref[r]`` is a running maximum of the scores added to the row. A new score above it rescales
    the row by exp(ref_old - ref_new) <= 1 first, so no exp() argument is ever positive and
    scores of any magnitude (200, 1e4, ...) cannot overflow float32.
  * Removing a key subtracts exactly the term that was added: scores are cached when computed,
    never recomputed (a recomputed score may differ in its last bit, a 1e-5 relative change of
    exp(score) at |score| ~ 200). The removed term is <= 1 in the row's units. If the departing key carried
    most of the row's mass (scores that rise and then fall), the difference loses precision. We
    track ``peak[r]``, the largest ``den[r]`` since the row was last computed from scratch: the
    rounding error of the row is about ``eps * peak``, so whenever ``den < TAU * peak`` the row is
    recomputed from its cached scores (O(n d) for that row only). With TAU = 1/16 the relative error stays
    below ~16 * (updates) * eps.
  * Rows with unbounded lifetime (fixed landmarks: a row is never recomputed) would accumulate
    the rounding of every add and remove. Continual Nyström keeps its m rows in float64 (``wide``):
    the float32 term removed is the one that was added, so each add/remove pair leaves ~1e-16
    relative error, so 10^5 steps do not drift (tested: within 1e-4 of recomputation), at no extra FLOPs (the rows are m x d).
    Retroactive rows live at most n steps by construction and stay float32.
Amortised cost: one max, two exps and a compare per row and step on top of the unstabilised
update, plus rare O(n d) refreshes (counted in the FLOPs of the step that does them). Each measure
can be turned off separately (``Stability``) so that `bench` can show what it costs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TAU = 1.0 / 16.0  # refresh a row when its denominator falls below TAU * its peak


@dataclass(frozen=True)
class Stability:
    """The three stability measures, each switchable (benchmarks only: turning one off loses the
    guarantee it gives)."""
    rescale: bool = True   # running-max references: no exp() argument above 0 (no overflow)
    refresh: bool = True   # rows recomputed from cached scores after cancellation
    wide: bool = True      # float64 running sums where rows live forever (no drift)

    @staticmethod
    def of(setting: "bool | Stability") -> "Stability":
        """``True`` / ``False`` for all measures on / off, or a ``Stability`` as it is."""
        if isinstance(setting, Stability):
            return setting
        return Stability(bool(setting), bool(setting), bool(setting))

    @property
    def any(self) -> bool:
        return self.rescale or self.refresh or self.wide


@dataclass
class RunningSums:
    ref: Tensor   # (B, R) reference (running max score)
    den: Tensor   # (B, R)
    num: Tensor   # (B, R, d)
    peak: Tensor  # (B, R) largest den since the last fresh computation, in ref units

    @staticmethod
    def empty(batch: int, rows: int, d: int, device, dtype) -> "RunningSums":
        return RunningSums(
            ref=torch.full((batch, rows), float("-inf"), device=device, dtype=dtype),
            den=torch.zeros(batch, rows, device=device, dtype=dtype),
            num=torch.zeros(batch, rows, d, device=device, dtype=dtype),
            peak=torch.zeros(batch, rows, device=device, dtype=dtype),
        )

    def view(self, rows: int) -> "RunningSums":
        """The first ``rows`` rows, sharing storage (in-place updates reach this object)."""
        return self.rows(0, rows)

    def rows(self, start: int, stop: int) -> "RunningSums":
        """Rows start..stop-1, sharing storage."""
        return RunningSums(self.ref[:, start:stop], self.den[:, start:stop],
                           self.num[:, start:stop], self.peak[:, start:stop])

    def assign_(self, index, fresh: "RunningSums") -> None:
        """Write the single-row sums ``fresh`` (X, 1, ...) at ``index``, e.g. (slice(None), r)
        for row r of every batch element, or (b_idx, r_idx) for scattered rows."""
        self.ref[index] = fresh.ref[:, 0]
        self.den[index] = fresh.den[:, 0]
        self.num[index] = fresh.num[:, 0]
        self.peak[index] = fresh.den[:, 0]

    def copy_(self, other: "RunningSums") -> None:
        for name in ("ref", "den", "num", "peak"):
            getattr(self, name).copy_(getattr(other, name))

    def clear_(self) -> None:
        self.ref.fill_(float("-inf"))
        self.den.zero_()
        self.num.zero_()
        self.peak.zero_()

    def output(self) -> Tensor:
        """(B, R, d) softmax-weighted values of every row."""
        return self.num / self.den.unsqueeze(-1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ref, self.den, self.num, self.peak))


@dataclass
class SumsScratch:
    """Preallocated buffers for updating R rows of running sums without allocating."""
    e: Tensor       # (B, R) exp terms
    tmp: Tensor     # (B, R) new references / stale-row floors
    flag: Tensor    # (B, R) bool
    any: Tensor     # () bool
    tau: Tensor     # () TAU as a tensor (a Python scalar operand would be wrapped per call)

    def view(self, rows: int) -> "SumsScratch":
        """The buffers of the first ``rows`` rows (for sums viewed with ``RunningSums.view``)."""
        return SumsScratch(self.e[:, :rows], self.tmp[:, :rows], self.flag[:, :rows], self.any, self.tau)

    @staticmethod
    def like(s: RunningSums) -> "SumsScratch":
        """Buffers for the rows of ``s``."""
        ref = s.ref
        return SumsScratch(e=torch.empty_like(ref), tmp=torch.empty_like(ref),
                           flag=torch.empty(ref.shape, dtype=torch.bool, device=ref.device),
                           any=torch.empty((), dtype=torch.bool, device=ref.device),
                           tau=torch.tensor(TAU, dtype=ref.dtype, device=ref.device))


def fresh_sums(scores: Tensor, values: Tensor) -> RunningSums:
    """Sums from scratch. scores: (B, R, n) already scaled; values: (B, n, d)."""
    ref = scores.amax(dim=-1)                                   # (B, R), in scores' dtype
    e = torch.exp(scores - ref.unsqueeze(-1))                   # (B, R, n)
    den = e.sum(dim=-1)
    return RunningSums(ref=ref, den=den, num=torch.bmm(e, values), peak=den.clone())


def add_key(s: RunningSums, scores: Tensor, v: Tensor, rescale: bool = True,
            scratch: SumsScratch | None = None) -> bool:
    """Add one key to every row in place. scores: (B, R) scaled; v: (B, d).

    ``rescale``: raise a row's reference (rescaling the row) when a score exceeds it; returns True
    when that happened to some row. Without it the peak (for refreshes) is not tracked either.
    ``scratch``: buffers for the rows of ``s`` (allocated here if not given).
    """
    b = scratch or SumsScratch.like(s)
    rescaled = False
    if rescale:
        torch.gt(scores, s.ref, out=b.flag)
        torch.any(b.flag, out=b.any)
        rescaled = bool(b.any)
    if rescaled:
        torch.maximum(s.ref, scores, out=b.tmp)                # the new references
        torch.sub(s.ref, b.tmp, out=b.e)
        b.e.exp_()                                              # <= 1; 0 for an empty row
        s.den.mul_(b.e)
        s.peak.mul_(b.e)
        s.num.mul_(b.e.unsqueeze(-1))
        s.ref.copy_(b.tmp)
    torch.sub(scores, s.ref, out=b.e)
    b.e.exp_()
    s.den.add_(b.e)
    s.num.addcmul_(b.e.unsqueeze(-1), v.unsqueeze(1))         # num += e v^T (rank 1)
    if rescale:
        torch.maximum(s.peak, s.den, out=s.peak)
    return rescaled


def remove_key(s: RunningSums, scores: Tensor, v: Tensor, scratch: SumsScratch | None = None) -> None:
    """Remove one key from every row in place (scores as it was added)."""
    b = scratch or SumsScratch.like(s)
    torch.sub(scores, s.ref, out=b.e)
    b.e.exp_()
    s.den.sub_(b.e)
    s.num.addcmul_(b.e.unsqueeze(-1), v.unsqueeze(1), value=-1.0)


def stale_rows(s: RunningSums, scratch: SumsScratch | None = None) -> Tensor | None:
    """(B, R) bool mask of rows whose cancellation error may exceed the tolerance, or None if
    there are none (the mask is ``scratch.flag``)."""
    b = scratch or SumsScratch.like(s)
    torch.mul(s.peak, b.tau, out=b.tmp)
    torch.lt(s.den, b.tmp, out=b.flag)
    torch.any(b.flag, out=b.any)
    return b.flag if bool(b.any) else None


def refresh_stale(s: RunningSums, row_scores, values: Tensor, valid: int,
                  scratch: SumsScratch | None = None) -> int:
    """Recompute the stale rows of ``s`` from their cached scores; returns how many.

    row_scores(b_idx, r_idx) -> (F, valid) must return the very scores that were added (cached,
    not recomputed: at |score| ~ 200 one rounding step of a recomputed score is a 1e-5 relative
    change of its exp). values: (B, n, d) ring of which the first ``valid`` slots are filled.
    """
    mask = stale_rows(s, scratch)
    if mask is None:
        return 0
    b_idx, r_idx = mask.nonzero(as_tuple=True)
    dt = s.num.dtype       # float64 rows are recomputed in float64
    s.assign_((b_idx, r_idx), fresh_sums(row_scores(b_idx, r_idx).unsqueeze(1).to(dt),
                                         values[b_idx, :valid].to(dt)))
    return int(b_idx.numel())
