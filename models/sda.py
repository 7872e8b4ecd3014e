"""Scaled dot-product attention: exact, Nyström, and their streaming (continual) forms.

Shapes: heads are folded into the batch, so every tensor is (B, n, d) with d the head dimension.
Batch functions are the references; ``StreamingSDA`` computes the same numbers one token at a time:

  regular            recompute softmax attention over the window each step (baseline)
  continual          Continual Single-Output / Retroactive SDA (Hedegaard et al.), exact
  nystrom            recompute Nyström attention over the window each step (baseline);
                     landmarks 'segment' (segment means of the window) or 'fixed'
  continual_nystrom  Continual Nyström SDA (Carreto Picón et al.); landmarks 'continual'
                     (stream-aligned segment means, see models/landmarks.py) or 'fixed'

Every variant answers from the first token (the window holds the newest min(t, n) tokens) and
equals its batch reference on that window at every step. Continual sums are stabilised as
explained in models/running_sums.py, so scores far beyond float32's exp range stay finite.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import flops as F
from .landmarks import ContinualLandmarks, check_landmarks, segment_means
from .running_sums import (TAU, RunningSums, add_key, fresh_sums, refresh_rows, remove_key,
                           stale_rows)


def inference(fn):
    """Run ``fn`` without autograd; cheap when grad mode is already off (nested steps)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


__all__ = ["attention", "nystrom_attention", "segment_means", "pinv", "StreamingSDA",
           "VARIANTS", "LANDMARK_MODES"]

VARIANTS = ("regular", "continual", "nystrom", "continual_nystrom")
LANDMARK_MODES = {"regular": (None,), "continual": (None,),
                  "nystrom": ("segment", "fixed"), "continual_nystrom": ("continual", "fixed")}


# ----------------------------------------------------------------------------- batch references

def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Exact softmax attention. q: (B, nq, d), k, v: (B, n, d) -> (B, nq, d), scale 1/sqrt(d)."""
    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))  # (B, nq, n)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def pinv(a: Tensor, iters: int = 6) -> Tensor:
    """Iterative Moore-Penrose inverse of a: (B, m, m) (Razavi et al., as in Nyströmformer).

    Z0 = a^T / (max column sum * max row sum), computed per matrix (not over the batch), then
    Z <- 1/4 Z (13 I - A Z (15 I - A Z (7 I - A Z))) ``iters`` times. The iteration runs in
    float64 whatever the input dtype (m x m is tiny, and the inverse amplifies rounding), and the
    result is cast back.
    """
    out_dtype = a.dtype
    a = a.double()
    absa = a.abs()
    norm = absa.sum(dim=-2).amax(dim=-1) * absa.sum(dim=-1).amax(dim=-1)        # (B,)
    z = a.transpose(-1, -2) / norm[..., None, None]
    eye = torch.eye(a.shape[-1], device=a.device, dtype=a.dtype)
    for _ in range(iters):
        az = torch.matmul(a, z)
        z = 0.25 * torch.matmul(z, 13 * eye - torch.matmul(az, 15 * eye - torch.matmul(az, 7 * eye - az)))
    return z.to(out_dtype)


def landmark_pinv(q_land: Tensor, k_land: Tensor, iters: int = 6) -> Tensor:
    """pinv(s(Q~ K~^T / sqrt(d))): (B, m, d) x 2 -> (B, m, m), in the landmarks' dtype.

    The m x m kernel is formed in float64: its rounding is what the pseudo-inverse amplifies, and
    at m x m x d it costs nothing next to the rest of the step.
    """
    s = 1.0 / math.sqrt(q_land.shape[-1])
    kernel = torch.softmax(torch.matmul(q_land.double() * s, k_land.double().transpose(-1, -2)), dim=-1)
    return pinv(kernel, iters).to(q_land.dtype)


def nystrom_attention(q: Tensor, k: Tensor, v: Tensor, q_land: Tensor, k_land: Tensor,
                      pinv_iters: int = 6) -> Tensor:
    """Nyström attention s(Q K~^T) s(Q~ K~^T)^+ s(Q~ K^T) V (Xiong et al.), scale 1/sqrt(d).

    q: (B, nq, d), k, v: (B, n, d), q_land, k_land: (B, m, d) -> (B, nq, d).
    """
    s = 1.0 / math.sqrt(q.shape[-1])
    k1 = torch.softmax(torch.matmul(q * s, k_land.transpose(-1, -2)), dim=-1)     # (B, nq, m)
    k3 = torch.softmax(torch.matmul(q_land * s, k.transpose(-1, -2)), dim=-1)     # (B, m, n)
    z = landmark_pinv(q_land, k_land, pinv_iters)                                 # (B, m, m)
    return torch.matmul(k1, torch.matmul(z, torch.matmul(k3, v)))


# ----------------------------------------------------------------------------- streaming

@dataclass
class StepWorkspace:
    """Preallocated buffers of the steady single-output continual Nyström step (see _fast_step)."""
    scores: Tensor      # (B, R, 1) new key against every row
    e: Tensor           # (B, R)
    tmp: Tensor         # (B, R)
    flag: Tensor        # (B, R) bool
    e_old: Tensor       # (B, m)
    floor: Tensor       # (B, m)
    stale: Tensor       # (B, m) bool
    any: Tensor         # () bool
    logits: Tensor      # (B, 1, m)
    probs: Tensor       # (B, 1, m)
    c: Tensor           # (B, 1, m)
    k_land_t: Tensor    # (B, d, m) scaled key landmarks, transposed once
    tau: Tensor         # () TAU as a tensor (a Python scalar operand would be wrapped per call)

    @staticmethod
    def build(q_rows_s: Tensor, k_land_s: Tensor) -> "StepWorkspace":
        B, R, d = q_rows_s.shape
        m = k_land_s.shape[1]
        def f(*shape, dtype=q_rows_s.dtype):
            return torch.empty(*shape, dtype=dtype, device=q_rows_s.device)
        return StepWorkspace(
            scores=f(B, R, 1), e=f(B, R), tmp=f(B, R), flag=f(B, R, dtype=torch.bool),
            e_old=f(B, m), floor=f(B, m), stale=f(B, m, dtype=torch.bool),
            any=f((), dtype=torch.bool), logits=f(B, 1, m), probs=f(B, 1, m), c=f(B, 1, m),
            k_land_t=k_land_s.transpose(1, 2).contiguous(),
            tau=torch.tensor(TAU, dtype=q_rows_s.dtype, device=q_rows_s.device))


@dataclass
class StreamState:
    """Everything a StreamingSDA remembers between steps (ring slot of token t is (t-1) % n)."""
    t: int = 0                          # tokens seen
    d: int = 0
    k: Tensor | None = None             # (B, n, d) key ring
    v: Tensor | None = None             # (B, n, d) value ring
    q: Tensor | None = None             # (B, n, d) query ring (recomputing and retroactive variants)
    rows: RunningSums | None = None     # continual retroactive: one row per query slot
    scores: Tensor | None = None        # (B, n, n) continual retroactive: scaled score of
                                        #   query slot i against key slot j, cached
    w: RunningSums | None = None        # continual Nyström rows: the m rows of s(Q~ K^T) V, then
                                        #   (fixed landmarks) m add-only shadow rows that replace
                                        #   them every n steps (no drift), updated in one go
    w_main: RunningSums | None = None   # view of the first m rows of w
    w_shadow: RunningSums | None = None # view of the shadow rows, or None
    q_rows_s: Tensor | None = None      # (B, R, d) scaled query landmarks, one per row of w
    shadow_count: int = 0
    ws: StepWorkspace | None = None     # single-output, stabilised: preallocated step buffers
    key_scores: Tensor | None = None    # (B, n, m) scaled scores of each key slot against q~
    q_land: Tensor | None = None        # (B, m, d) landmarks in use (unscaled)
    k_land: Tensor | None = None
    q_land_s: Tensor | None = None      # the same, scaled by 1/sqrt(d)
    k_land_s: Tensor | None = None
    z: Tensor | None = None             # (B, m, m) pinv(s(q~ k~^T))
    p: Tensor | None = None             # (B, n, m) s(q_i k~^T) per query slot (retroactive)
    refreshed: int = 0                  # rows recomputed for stability in the last step


class StreamingSDA:
    """One attention variant computed token by token. Heads are folded into the batch B.

    ``reset(B)`` then ``step(q, k, v)`` with q, k, v: (B, d) each step; returns (B, d) for the
    newest token (single-output) or (B, n_t, d) for every token of the window, oldest first
    (retroactive), n_t = min(t, window). Stepping before ``reset`` raises RuntimeError.
    ``step_window(q, k, v)`` is the single-output layer that follows a retroactive one: q (B, d) is
    the newest query and k, v (B, n_t, d) the whole (recomputed) window.
    ``stabilize=False`` turns off the overflow/cancellation protection (for benchmarks only).
    Streaming is inference: steps run without autograd.
    """

    def __init__(self, variant: str, window: int, *, retroactive: bool = False,
                 num_landmarks: int | None = None, landmark_mode: str | None = None,
                 fixed_landmarks: tuple[Tensor, Tensor] | None = None, pinv_iters: int = 6,
                 stabilize: bool = True):
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.variant, self.n, self.retroactive = variant, window, bool(retroactive)
        self.pinv_iters, self.stabilize = pinv_iters, stabilize
        self.st: StreamState | None = None
        self._batch: int | None = None
        self._p_rebuilt = False
        self.nystrom = variant in ("nystrom", "continual_nystrom")
        if not self.nystrom:
            if landmark_mode is not None or num_landmarks is not None or fixed_landmarks is not None:
                raise ValueError(f"variant {variant!r} takes no landmarks; valid landmark modes: "
                                 f"{LANDMARK_MODES[variant]}")
            self.m, self.mode, self.fixed = None, None, None
        else:
            if num_landmarks is None and fixed_landmarks is not None:
                num_landmarks = fixed_landmarks[0].shape[-2]
            if num_landmarks is None:
                raise ValueError(f"variant {variant!r} needs num_landmarks (1 <= m <= {window})")
            check_landmarks(window, num_landmarks)
            self.m = num_landmarks
            self.mode = None
            self.fixed = None
            self.set_landmark_mode(landmark_mode or LANDMARK_MODES[variant][0], fixed_landmarks)
        self.tracker = (ContinualLandmarks(window, self.m)
                        if variant == "continual_nystrom" else None)
        self._flops_args = None

    @property
    def last_step(self) -> F.Flops:
        """Analytic FLOPs of the last step for the whole batch (all folded heads and sequences),
        matrix products separate. Computed on demand from what the step did."""
        if self._flops_args is None:
            return F.Flops()
        formula, args, kw, n_t, refreshed, d = self._flops_args
        return self._batch * formula(*args, **kw) + F.refresh(refreshed, n_t, d)

    @property
    def last_step_flops(self) -> int:
        return self.last_step.total

    @property
    def landmark_updated(self) -> bool:
        """True if the last step installed new landmarks (and their pseudo-inverse), not counting
        the warm-up rule's per-step rebuilds: with continual landmarks and the window full, every
        n/m steps; also the first install of a window-fed block."""
        if self._flops_args is None:
            return False
        kw = self._flops_args[2]
        return kw.get("event") == "landmark" or (kw.get("landmark_update", False)
                                                 and not kw.get("warmup_landmarks", False))

    def _account(self, formula, *args, n_t: int = 0, **kw) -> None:
        st = self.st
        self._flops_args = (formula, args, kw, n_t, st.refreshed, st.d)

    # ------------------------------------------------------------------ configuration
    def set_landmark_mode(self, mode: str, fixed_landmarks: tuple[Tensor, Tensor] | None = None):
        """Switch landmark mode; allowed mid-stream (the next step uses the new landmarks)."""
        valid = LANDMARK_MODES[self.variant]
        if mode not in valid:
            raise ValueError(f"unknown landmark mode {mode!r} for {self.variant!r}; valid: {valid}")
        if fixed_landmarks is not None:
            ql, kl = fixed_landmarks
            if ql.dim() not in (2, 3) or ql.shape != kl.shape or ql.shape[-2] != self.m:
                raise ValueError(f"fixed landmarks must be two tensors of shape (m={self.m}, d) or "
                                 f"(H, m, d); got {tuple(ql.shape)} and {tuple(kl.shape)}")
            self.fixed = (ql.detach(), kl.detach())
        if mode == "fixed" and self.fixed is None:
            raise ValueError("landmark_mode 'fixed' needs fixed_landmarks=(q_land, k_land); "
                             "fit them with models.landmarks.fit_fixed_landmarks")
        changed = mode != self.mode or fixed_landmarks is not None
        self.mode = mode
        st = self.st
        if changed and st is not None and st.t > 0 and self.variant == "continual_nystrom":
            if st.k is None:          # window-fed layer: reinstall on the next step
                st.z = None
            else:
                self._install_landmarks(*self._landmark_source())
                self._fresh_w()
                st.p = None

    # ------------------------------------------------------------------ lifecycle
    def reset(self, batch_size: int, device=None, dtype=None) -> None:
        """Start a new stream of ``batch_size`` sequences. Buffers are allocated on the first step."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self._batch = batch_size
        self._device = torch.device(device) if device is not None else None
        self._dtype = dtype
        self.st = StreamState()
        self._flops_args = None

    def landmarks(self) -> tuple[Tensor, Tensor] | None:
        """(q_land, k_land) (B, m', d) used by the last step (oldest segment first), or None."""
        st = self.st
        if not self.nystrom or st is None or st.t == 0:
            return None
        if self.variant == "continual_nystrom" and self.mode == "continual":
            return self.tracker.chronological()
        return st.q_land, st.k_land

    def state_nbytes(self) -> int:
        """Bytes held by the streaming state."""
        st = self.st
        if st is None:
            return 0
        tensors = [st.k, st.v, st.q, st.scores, st.key_scores, st.q_land, st.k_land, st.z, st.p]
        total = sum(x.numel() * x.element_size() for x in tensors if x is not None)
        total += sum(s.nbytes() for s in (st.rows, st.w) if s is not None)
        if self.tracker is not None:
            total += self.tracker.nbytes()
        return total

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

    def _begin(self, q: Tensor, k: Tensor, v: Tensor, window_input: bool) -> StreamState:
        if self.st is None:
            raise RuntimeError("StreamingSDA.step called before reset(batch_size)")
        B, st = self._batch, self.st
        if st.d and not window_input and self._fast_ok(q, k, v):
            return st
        d = st.d or (q.shape[-1] if isinstance(q, Tensor) and q.dim() == 2 else None)
        self._check("q", q, (B, d))
        kv_shape = (B, None, d) if window_input else (B, d)
        self._check("k", k, kv_shape)
        self._check("v", v, kv_shape)
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if window_input and (k.shape[1] != v.shape[1] or not 1 <= k.shape[1] <= self.n):
            raise ValueError(f"k, v windows must have 1..{self.n} tokens, got {k.shape[1]}, {v.shape[1]}")
        if st.d == 0:             # first step: the stream takes the inputs' dtype and device
            self._dtype, self._device = q.dtype, q.device
            self._allocate(d, q.device, q.dtype, window_input)
        if self.fixed is not None and self.mode == "fixed" and self.fixed[0].shape[-1] != d:
            raise ValueError(f"fixed landmarks have d={self.fixed[0].shape[-1]}, inputs have d={d}")
        return st

    def _fast_ok(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Cheap check for the common case: (B, d) tensors of the stream's dtype and device."""
        want, dt, dev = (self._batch, self.st.d), self._dtype, self._device
        return (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
                and q.shape == want and k.shape == want and v.shape == want
                and q.dtype == dt and k.dtype == dt and v.dtype == dt
                and q.device == dev and k.device == dev and v.device == dev)

    def _allocate(self, d: int, device, dtype, window_input: bool) -> None:
        st, B, n = self.st, self._batch, self.n
        st.d = d
        z = lambda *s: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
        if not window_input:
            st.k, st.v = z(B, n, d), z(B, n, d)
            if self.variant in ("regular", "nystrom") or self.retroactive:
                st.q = z(B, n, d)
            if self.variant == "continual_nystrom":
                st.key_scores = z(B, n, self.m)
        if self.tracker is not None:
            self.tracker.reset(B, d, device, dtype)

    def _expand_fixed(self) -> tuple[Tensor, Tensor]:
        ql, kl = self.fixed
        B = self._batch
        if ql.dim() == 2:
            ql, kl = ql.unsqueeze(0), kl.unsqueeze(0)
        if B % ql.shape[0]:
            raise ValueError(f"fixed landmarks for {ql.shape[0]} heads do not divide batch {B}")
        reps = B // ql.shape[0]
        cast = dict(device=self._device, dtype=self._dtype)
        return ql.to(**cast).repeat(reps, 1, 1), kl.to(**cast).repeat(reps, 1, 1)

    def _window_order(self, st: StreamState) -> Tensor:
        """Ring slots of the window, oldest first: (n_t,) long."""
        n_t = min(st.t, self.n)
        return (torch.arange(n_t, device=st.k.device) + (st.t - n_t)) % self.n

    # ------------------------------------------------------------------ stepping
    @inference
    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v: (B, d) -> (B, d) single-output or (B, n_t, d) retroactive."""
        st = self._begin(q, k, v, window_input=False)
        slot = st.t % self.n
        full = st.t >= self.n
        st.t += 1
        st.refreshed = 0
        if self.variant == "continual_nystrom":
            return self._step_continual_nystrom(st, q, k, v, slot, full)
        if self.variant == "continual" and self.retroactive:
            return self._step_continual_retro(st, q, k, v, slot, full)
        self._write(st, slot, q, k, v)
        if self.variant == "regular":
            return self._step_regular(st)
        if self.variant == "nystrom":
            return self._step_nystrom(st)
        return self._step_continual_single(st, q)

    @staticmethod
    def _write(st: StreamState, slot: int, q: Tensor, k: Tensor, v: Tensor) -> None:
        """Store the newest token in ring slot ``slot`` (overwriting the departing one)."""
        st.k[:, slot] = k
        st.v[:, slot] = v
        if st.q is not None:
            st.q[:, slot] = q

    def _window(self, st: StreamState):
        idx = self._window_order(st)
        return st.q[:, idx], st.k[:, idx], st.v[:, idx]

    def _step_regular(self, st: StreamState) -> Tensor:
        qw, kw, vw = self._window(st)
        out = attention(qw, kw, vw)                                    # (B, n_t, d)
        self._account(F.regular_sda, qw.shape[1], st.d)
        return out if self.retroactive else out[:, -1]

    def _step_nystrom(self, st: StreamState) -> Tensor:
        qw, kw, vw = self._window(st)
        n_t = qw.shape[1]
        if self.mode == "fixed":
            ql, kl = self._expand_fixed()
        else:
            ql, kl = segment_means(qw, min(self.m, n_t)), segment_means(kw, min(self.m, n_t))
        st.q_land, st.k_land = ql, kl
        out = nystrom_attention(qw, kw, vw, ql, kl, self.pinv_iters)
        self._account(F.nystrom_sda, n_t, st.d, ql.shape[1], self.pinv_iters,
                      segment=self.mode == "segment")
        return out if self.retroactive else out[:, -1]

    def _step_continual_single(self, st: StreamState, q: Tensor) -> Tensor:
        n_t = min(st.t, self.n)
        out = attention(q.unsqueeze(1), st.k[:, :n_t], st.v[:, :n_t])[:, 0]
        self._account(F.continual_sda, n_t, st.d)
        return out

    def _step_continual_retro(self, st, q, k, v, slot, full) -> Tensor:
        n_t, scale = min(st.t, self.n), 1.0 / math.sqrt(st.d)
        rescaled = False
        if st.rows is None:
            st.rows = RunningSums.empty(self._batch, self.n, st.d, st.k.device, st.k.dtype)
            st.scores = torch.zeros(self._batch, self.n, self.n, device=st.k.device, dtype=st.k.dtype)
        rows, S = st.rows.view(n_t), st.scores
        if full:    # the departing key leaves every row (with the scores it was added with)
            remove_key(rows, S[:, :n_t, slot], st.v[:, slot])
        self._write(st, slot, q, k, v)
        # the new key joins every row (the row in `slot` is overwritten below)
        if st.t > 1:
            column = torch.bmm(st.q[:, :n_t], k.unsqueeze(-1)).squeeze(-1) * scale    # (B, n_t)
            rescaled = add_key(rows, column, v, self.stabilize)
            S[:, :n_t, slot] = column
        # the newest query's row, from scratch over the window
        row = torch.bmm(st.k[:, :n_t], q.unsqueeze(-1)).squeeze(-1) * scale             # (B, n_t)
        S[:, slot, :n_t] = row
        rows.assign_((slice(None), slot), fresh_sums(row.unsqueeze(1), st.v[:, :n_t]))
        if self.stabilize and st.t > 1:
            st.refreshed = refresh_rows(rows, stale_rows(rows), lambda b, r: S[b, r, :n_t],
                                        st.v, n_t)
        out = rows.output()[:, self._window_order(st)]
        self._account(F.continual_retroactive_sda, n_t, st.d, n_t=n_t, first=st.t == 1,
                      evict=full, stabilize=self.stabilize, rescaled=rescaled)
        return out

    # ------------------------------------------------------------------ continual Nyström
    def _landmark_source(self) -> tuple[Tensor, Tensor]:
        if self.mode == "fixed":
            return self._expand_fixed()
        return self.tracker.current()

    def _install_landmarks(self, ql: Tensor, kl: Tensor) -> None:
        st = self.st
        s = 1.0 / math.sqrt(st.d)
        st.q_land, st.k_land = ql.clone(), kl.clone()
        st.q_land_s, st.k_land_s = ql * s, kl * s
        st.z = landmark_pinv(ql, kl, self.pinv_iters)

    def _fresh_w(self) -> None:
        """Rows of s(Q~ K^T) V from scratch over the stored window, and every key's scores."""
        st = self.st
        n_t = min(st.t, self.n)
        scores = torch.matmul(st.q_land_s, st.k[:, :n_t].transpose(1, 2))      # (B, m', n_t)
        fresh = fresh_sums(scores, st.v[:, :n_t])
        if scores.shape[1] == self.m:
            st.key_scores[:, :n_t] = scores.transpose(1, 2)
        st.shadow_count = 0
        if self.mode == "fixed" and self.stabilize:
            m = self.m
            st.w = RunningSums.empty(self._batch, 2 * m, st.d, st.k.device, st.k.dtype)
            st.w_main, st.w_shadow = st.w.view(m), st.w.rows(m, 2 * m)
            st.w_main.copy_(fresh)
            st.q_rows_s = torch.cat([st.q_land_s, st.q_land_s], dim=1)
        else:
            st.w = st.w_main = fresh
            st.w_shadow, st.q_rows_s = None, st.q_land_s
        self._build_workspace()

    def _build_workspace(self) -> None:
        st = self.st
        fast = self.stabilize and not self.retroactive and st.q_land_s.shape[1] == self.m
        st.ws = StepWorkspace.build(st.q_rows_s, st.k_land_s) if fast else None

    def _step_continual_nystrom(self, st, q, k, v, slot, full) -> Tensor:
        n_t, d, m = min(st.t, self.n), st.d, self.m
        changed = self.tracker.push(q, k)
        fixed = self.mode == "fixed"
        event, rescaled = "step", False
        warmup = not fixed and not self.tracker.warm
        just_warm = not fixed and changed and self.tracker.state.completed == m
        if st.ws is not None and st.w is not None and not (warmup or just_warm) and (fixed or not changed):
            return self._fast_step(st, q, k, v, slot, full)
        if st.w is None or warmup or just_warm:
            # first step, or warm-up with continual landmarks: landmarks change every step
            self._write(st, slot, q, k, v)
            self._install_landmarks(*self._landmark_source())
            self._fresh_w()
            st.p = None
            event = "rebuild"
        else:
            # incremental update with the landmarks of the previous step
            if full:   # the departing key leaves the main rows, with the scores it was added with
                remove_key(st.w_main, st.key_scores[:, slot], st.v[:, slot])
            self._write(st, slot, q, k, v)
            new_scores = torch.bmm(st.q_rows_s, k.unsqueeze(-1)).squeeze(-1)         # (B, R)
            rescaled = add_key(st.w, new_scores, v, self.stabilize)
            st.key_scores[:, slot] = new_scores[:, :m]
            event = self._advance_shadow(st)
            if not fixed and changed:
                # one slot got a new landmark: its row is recomputed over the window
                r = (self.tracker.state.completed - 1) % m
                self._install_landmarks(*self.tracker.current())
                st.q_rows_s = st.q_land_s
                self._build_workspace()
                row_scores = torch.bmm(st.k[:, :n_t], st.q_land_s[:, r].unsqueeze(-1)).squeeze(-1)
                st.w.assign_((slice(None), r), fresh_sums(row_scores.unsqueeze(1), st.v[:, :n_t]))
                st.key_scores[:, :n_t, r] = row_scores
                st.p = None
                event = "landmark"
            if self.stabilize:
                st.refreshed = refresh_rows(st.w_main, stale_rows(st.w_main),
                                            lambda b, r: st.key_scores[b, :n_t, r], st.v, n_t)
        a = torch.softmax(torch.bmm(q.unsqueeze(1), st.k_land_s.transpose(1, 2)), dim=-1)  # (B,1,m)
        if self.retroactive:
            out = self._retro_nystrom_output(st, a, slot, n_t)
        else:
            c = torch.bmm(a, st.z).div_(st.w_main.den.unsqueeze(1))                     # (B, 1, m)
            out = torch.bmm(c, st.w_main.num)[:, 0]                                      # (B, d)
        self._account(F.continual_nystrom_sda, n_t, d, st.q_land.shape[1], self.pinv_iters,
                      n_t=n_t, event=event, retroactive=self.retroactive, evict=full,
                      stabilize=self.stabilize, p_rebuilt=self.retroactive and self._p_rebuilt,
                      warmup_landmarks=warmup, shadow=st.w_shadow is not None, rescaled=rescaled)
        return out

    def _advance_shadow(self, st: StreamState) -> str:
        """Count a key into the shadow rows; after n keys they hold exactly the window and
        replace the main rows (returns 'swap'), else 'step'."""
        if st.w_shadow is None:
            return "step"
        st.shadow_count += 1
        if st.shadow_count < self.n:
            return "step"
        st.w_main.copy_(st.w_shadow)
        st.w_shadow.clear_()
        st.shadow_count = 0
        return "swap"

    def _fast_step(self, st: StreamState, q: Tensor, k: Tensor, v: Tensor, slot: int,
                   full: bool) -> Tensor:
        """Steady single-output step (fixed landmarks, or continual ones between landmark
        updates), stabilised: O(m d) work, no allocation but the output.

        The same arithmetic as the general path (and the same FLOP formula), written with
        preallocated buffers: remove the departing key from the main rows, add the new key to
        every row (fixed landmarks: main and shadow; rescaling only if a reference must rise),
        swap in the shadow every n steps, refresh rows that lost precision (rare; that path
        allocates), output.
        The caller has already fed q, k to the landmark tracker (a live switch to 'continual'
        needs its stream-aligned segments).
        """
        ws, w, main, m = st.ws, st.w, st.w_main, self.m
        n_t = min(st.t, self.n)
        if full:
            torch.sub(st.key_scores[:, slot], main.ref, out=ws.e_old)
            ws.e_old.exp_()
            main.den.sub_(ws.e_old)
            main.num.addcmul_(ws.e_old.unsqueeze(-1), st.v[:, slot].unsqueeze(1), value=-1.0)
        st.k[:, slot].copy_(k)
        st.v[:, slot].copy_(v)
        torch.bmm(st.q_rows_s, k.unsqueeze(-1), out=ws.scores)
        scores = ws.scores.squeeze(-1)                                             # (B, R)
        torch.gt(scores, w.ref, out=ws.flag)
        torch.any(ws.flag, out=ws.any)
        rescaled = bool(ws.any)
        if rescaled:                                   # a reference rises: rescale all rows
            torch.maximum(w.ref, scores, out=ws.tmp)
            torch.sub(w.ref, ws.tmp, out=ws.e)
            ws.e.exp_()
            w.den.mul_(ws.e)
            w.peak.mul_(ws.e)
            w.num.mul_(ws.e.unsqueeze(-1))
            w.ref.copy_(ws.tmp)
        torch.sub(scores, w.ref, out=ws.e)
        ws.e.exp_()
        w.den.add_(ws.e)
        w.num.addcmul_(ws.e.unsqueeze(-1), v.unsqueeze(1))
        torch.maximum(w.peak, w.den, out=w.peak)
        st.key_scores[:, slot].copy_(scores[:, :m])
        event = self._advance_shadow(st)
        torch.mul(main.peak, ws.tau, out=ws.floor)
        torch.lt(main.den, ws.floor, out=ws.stale)
        torch.any(ws.stale, out=ws.any)
        if bool(ws.any):
            st.refreshed = refresh_rows(main, ws.stale, lambda b, r: st.key_scores[b, :n_t, r],
                                        st.v, n_t)
        torch.bmm(q.unsqueeze(1), ws.k_land_t, out=ws.logits)
        torch.softmax(ws.logits, dim=-1, out=ws.probs)
        torch.bmm(ws.probs, st.z, out=ws.c)
        ws.c.div_(main.den.unsqueeze(1))
        out = torch.bmm(ws.c, main.num).squeeze(1)                                # (B, d)
        self._account(F.continual_nystrom_sda, n_t, st.d, m, self.pinv_iters, n_t=n_t,
                      event=event, retroactive=False, evict=full, stabilize=True,
                      p_rebuilt=False, warmup_landmarks=False, shadow=st.w_shadow is not None,
                      rescaled=rescaled)
        return out

    def _retro_nystrom_output(self, st, a, slot, n_t) -> Tensor:
        self._p_rebuilt = st.p is None
        if st.p is None:
            st.p = torch.zeros(self._batch, self.n, st.q_land.shape[1], device=st.k.device,
                               dtype=st.k.dtype)
            st.p[:, :n_t] = torch.softmax(
                torch.matmul(st.q[:, :n_t], st.k_land_s.transpose(1, 2)), dim=-1)
        else:
            st.p[:, slot] = a[:, 0]
        zw = torch.bmm(st.z, st.w_main.output())                                     # (B, m, d)
        out = torch.bmm(st.p[:, :n_t], zw)                                           # (B, n_t, d)
        return out[:, self._window_order(st)]

    # ------------------------------------------------------------------ after a retroactive layer
    @inference
    def step_window(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Newest query over a recomputed window. q: (B, d), k, v: (B, n_t, d) -> (B, d)."""
        if self.variant not in ("continual", "continual_nystrom") or self.retroactive:
            raise ValueError("step_window is the single-output layer after a retroactive one; "
                             "use it with variant 'continual' or 'continual_nystrom', retroactive=False")
        st = self._begin(q, k, v, window_input=True)
        st.t += 1
        n_t, d = k.shape[1], st.d
        if self.variant == "continual":
            self._account(F.continual_sda, n_t, d)
            return attention(q.unsqueeze(1), k, v)[:, 0]
        changed = self.tracker.push(q, k[:, -1])
        event = "step"
        warmup = self.mode == "continual" and not self.tracker.warm
        if st.z is None or (self.mode == "continual" and changed):
            self._install_landmarks(*self._landmark_source())
            event = "landmark"
        k1 = torch.softmax(torch.bmm(q.unsqueeze(1), st.k_land_s.transpose(1, 2)), dim=-1)
        k3 = torch.softmax(torch.bmm(st.q_land_s, k.transpose(1, 2)), dim=-1)   # (B, m, n_t)
        out = torch.bmm(torch.bmm(k1, st.z), torch.bmm(k3, v))[:, 0]
        self._account(F.windowed_nystrom_sda, n_t, d, st.q_land.shape[1], self.pinv_iters,
                      landmark_update=event == "landmark", warmup_landmarks=warmup)
        return out

