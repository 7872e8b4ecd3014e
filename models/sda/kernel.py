"""What every streaming SDA kernel shares: the call contract, input checks, the ring buffer and
the record of what a step did (from which its FLOPs are computed).

Contract (heads folded into the batch B, d the head dimension):
  reset(B)                      start new streams (buffers are allocated on the first step)
  step(q, k, v)                 q, k, v: (B, d) newest token -> (B, d) single-output, or
                                (B, n_t, d) for every token of the window, oldest first
                                (retroactive); n_t = min(t, window)
  step_window(q, kv)            single-output layer after a retroactive one: q (B, d) newest
                                query, kv the whole (recomputed) window: KeyValues(k, v) with
                                k, v (B, n_t, d), or FoldedKeyValues (models/sda/window.py)
  landmarks()                   (q_land, k_land) the last step used, or None
  report / last_step            what the last step did / its FLOPs for the whole batch

``fused=True``: steady steps (those that change no landmark) run in one compiled call
(models/fused/) on the same state, so fused and torch steps can alternate freely; rare steps
(first, warm-up, landmark updates) take the torch path.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .. import flops as F
from ..running_sums import Stability
from .window import FoldedKeyValues, KeyValues


@dataclass
class StepReport:
    """What the last step did. Its FLOP count (``SDAKernel.last_step``) and the app's reporting
    (landmark updates, refreshes) both read this record."""
    n_t: int = 0                     # tokens in the window after the step
    first: bool = False              # the stream's first token
    event: str = "step"              # 'step' incremental | 'rebuild' landmarks, pinv and rows from
                                     #   scratch | 'landmark' one new landmark and its pinv |
                                     #   'window' landmarks of a recomputed window (window-fed)
    evicted: bool = False            # the departing key was removed from the cached sums
    rescaled: bool = False           # a row reference rose, so every row was rescaled
    rows_refreshed: int = 0          # rows recomputed for stability (whole batch)
    warmup_landmarks: bool = False   # continual landmarks still follow the warm-up rule
    p_rebuilt: bool = False          # retroactive Nyström: s(q_i K~^T) rebuilt for every query

    @property
    def landmark_update(self) -> bool:
        """New landmarks (and pseudo-inverse) installed, not counting warm-up rebuilds."""
        return self.event == "landmark" and not self.warmup_landmarks


@dataclass
class StreamState:
    """Fields every kernel's state has; each kernel's own state dataclass extends it."""
    t: int = 0        # tokens seen
    d: int = 0        # head dimension, 0 until the first step


_fused_kernels = None


def fused_kernels():
    """models.fused.kernels, imported on first use (it compiles with numba) and kept: an import
    statement per step cost ~0.7 us of a ~15 us fused SDA step when timed during development."""
    global _fused_kernels
    if _fused_kernels is None:
        from ..fused import kernels
        _fused_kernels = kernels
    return _fused_kernels


def nbytes(obj, seen: set | None = None) -> int:
    """Bytes of every tensor reachable through ``obj``'s dataclass fields (views counted once)."""
    seen = set() if seen is None else seen
    if isinstance(obj, Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if dataclasses.is_dataclass(obj):
        return sum(nbytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return 0


def window_order(t: int, n: int, device) -> Tensor:
    """Ring slots of the window after t tokens, oldest first: (min(t, n),) long."""
    n_t = min(t, n)
    return (torch.arange(n_t, device=device) + (t - n_t)) % n


WINDOW_ONLY = ("step_window is the single-output layer after a retroactive one; use it with "
               "variant 'continual' or 'continual_nystrom', retroactive=False")


class SDAKernel(abc.ABC):
    """Base of the streaming kernels; subclasses set ``variant`` and implement ``_allocate``,
    ``_step`` and ``flops``."""
    variant = ""
    takes_landmarks = False

    def __init__(self, window: int, *, retroactive: bool = False, stabilize: bool | Stability = True,
                 fused: bool = False):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.n, self.retroactive = window, bool(retroactive)
        self.stability = Stability.of(stabilize)
        self.fused = fused       # steady steps in the compiled CPU kernel (models/fused/)
        self.st: StreamState | None = None
        self.report = StepReport()
        self._batch: int | None = None
        self._dtype = self._device = None
        self._fuse_ok = False

    # ------------------------------------------------------------------ lifecycle
    def reset(self, batch_size: int, device=None, dtype=None) -> None:
        """Start a new stream of ``batch_size`` sequences. Buffers are allocated on the first step."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self._batch = batch_size
        self._device = torch.device(device) if device is not None else None
        self._dtype = dtype
        self.st = self._new_state()
        self.report = StepReport()

    def _new_state(self) -> StreamState:
        return StreamState()

    @abc.abstractmethod
    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v: (B, d) newest token -> (B, d), or (B, n_t, d) when retroactive."""

    def step_window(self, q: Tensor, kv) -> Tensor:
        raise ValueError(WINDOW_ONLY)

    def landmarks(self) -> tuple[Tensor, Tensor] | None:
        return None

    def set_landmark_mode(self, mode: str, fixed_landmarks=None) -> None:
        raise ValueError(f"variant {self.variant!r} takes no landmarks")

    def state_nbytes(self) -> int:
        """Bytes held by the streaming state (rings, cached sums, landmarks, step buffers)."""
        return nbytes(self.st) if self.st is not None else 0

    # ------------------------------------------------------------------ cost of the last step
    @abc.abstractmethod
    def flops(self, r: StepReport) -> F.Flops:
        """FLOPs of a step that did ``r``, for one sequence (refreshes excluded)."""

    @property
    def last_step(self) -> F.Flops:
        """Analytic FLOPs of the last step for the whole batch (all folded heads and sequences)."""
        r = self.report
        if self.st is None or self.st.t == 0:
            return F.Flops()
        return self._batch * self.flops(r) + F.refresh(r.rows_refreshed, r.n_t, self.st.d)

    @property
    def last_step_flops(self) -> int:
        return self.last_step.total

    @property
    def landmark_updated(self) -> bool:
        return self.report.landmark_update

    # ------------------------------------------------------------------ checks and buffers
    def _check(self, name: str, x: Tensor, shape: tuple) -> None:
        if not isinstance(x, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape {shape}, got {type(x).__name__}")
        if x.dim() != len(shape) or any(s is not None and s != xs for s, xs in zip(shape, x.shape)):
            want = "(" + ", ".join("?" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
        if self._dtype is not None and x.dtype != self._dtype:
            raise ValueError(f"{name} has dtype {x.dtype}, the stream was reset with {self._dtype}")
        if self._device is not None and x.device.type != self._device.type:
            raise ValueError(f"{name} is on {x.device}, the stream was reset on {self._device}")

    def _begin(self, q: Tensor, k: Tensor, v: Tensor, window_input: bool = False) -> StreamState:
        """Check the inputs (cheaply in the common case); allocate on the first step."""
        if self.st is None:
            raise RuntimeError(f"{type(self).__name__}.step called before reset(batch_size)")
        B, st = self._batch, self.st
        if st.d and not window_input and self._fast_ok(q, k, v):
            return st
        d = st.d or (q.shape[-1] if isinstance(q, Tensor) and q.dim() == 2 else None)
        self._check("q", q, (B, d))
        if window_input:
            self._check_window(k, B, d)
            k, v = (k.k, k.v) if isinstance(k, KeyValues) else (k.x, k.w_v)
        else:
            self._check("k", k, (B, d))
            self._check("v", v, (B, d))
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if st.d == 0:             # first step: the stream takes the inputs' dtype and device
            self._dtype, self._device = q.dtype, q.device
            self._fuse_ok = q.dtype == torch.float32 and q.device.type == "cpu"
            st.d = d
            self._allocate(d, q.device, q.dtype, window_input)
        self._check_more(d)
        return st

    def _advance(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[StreamState, int, bool, int]:
        """Check a step's inputs and count its token: (state, the ring slot the token takes,
        whether the window was full before it, n_t)."""
        st = self._begin(q, k, v)
        slot, full = st.t % self.n, st.t >= self.n
        st.t += 1
        return st, slot, full, min(st.t, self.n)

    def _advance_window(self, q: Tensor, kv) -> StreamState:
        """The same for ``step_window`` (a single-output kernel after a retroactive layer)."""
        if self.retroactive:
            raise ValueError(WINDOW_ONLY)
        st = self._begin(q, kv, None, window_input=True)
        st.t += 1
        return st

    def _check_window(self, kv, B: int, d: int | None) -> None:
        """kv: a models.sda.window.KeyValues / FoldedKeyValues of (B, 1..n, d) keys and values."""
        if not isinstance(kv, (KeyValues, FoldedKeyValues)):
            raise ValueError(f"step_window takes its window as KeyValues(k, v) or FoldedKeyValues, "
                             f"got {type(kv).__name__}")
        shape = kv.shape
        if shape[0] != B or (d is not None and shape[2] != d) or not 1 <= shape[1] <= self.n:
            raise ValueError(f"the window's keys and values must be ({B}, 1..{self.n}, "
                             f"{d if d is not None else '?'}), got {shape}")

    def _fusable(self) -> bool:
        """The fused kernel may take steps of this stream (asked for, float32 on the CPU)."""
        return self.fused and self._fuse_ok

    def _as_arrays(self, q: Tensor, k: Tensor, v: Tensor):
        """q, k, v as numpy views for the fused kernel, or None if any is not a (B, d) float32
        contiguous CPU tensor without grad (the torch path then takes the step and checks it)."""
        try:
            a = (q.numpy(), k.numpy(), v.numpy())
        except (AttributeError, RuntimeError, TypeError):
            return None
        want = (self._batch, self.st.d)
        for x in a:
            if x.shape != want or x.dtype != np.float32 or not x.flags.c_contiguous:
                return None
        return a

    def _check_more(self, d: int) -> None:
        """Kernel-specific checks of the first or an unusual step."""

    def _fast_ok(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Cheap check for the common case: (B, d) tensors of the stream's dtype and device."""
        want, dt, dev = (self._batch, self.st.d), self._dtype, self._device
        return (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
                and q.shape == want and k.shape == want and v.shape == want
                and q.dtype == dt and k.dtype == dt and v.dtype == dt
                and q.device == dev and k.device == dev and v.device == dev)

    def _allocate(self, d: int, device, dtype, window_input: bool) -> None:
        """Allocate the state's buffers for head dimension d."""

    def _zeros(self, *shape) -> Tensor:
        return torch.zeros(*shape, device=self._device, dtype=self._dtype)


@dataclass
class Ring:
    """The newest n tokens' keys and values (and queries where a kernel needs them); the ring
    slot of token t (1-based) is (t - 1) % n."""
    k: Tensor                  # (B, n, d)
    v: Tensor                  # (B, n, d)
    q: Tensor | None = None    # (B, n, d)

    def write(self, slot: int, q: Tensor, k: Tensor, v: Tensor) -> None:
        """Store the newest token in ``slot`` (overwriting the departing one)."""
        self.k[:, slot].copy_(k)
        self.v[:, slot].copy_(v)
        if self.q is not None:
            self.q[:, slot].copy_(q)

    def ordered(self, t: int) -> tuple[Tensor | None, Tensor, Tensor]:
        """q, k, v of the window, oldest first: (B, n_t, d) each (q None if not kept)."""
        idx = window_order(t, self.k.shape[1], self.k.device)
        return (self.q[:, idx] if self.q is not None else None), self.k[:, idx], self.v[:, idx]
