"""One attention layer streamed on its own, q, k, v given per token: the SDA rows of `bench`
(each variant's step against its FLOPs, the cost of each stability measure) and the SDA tests
(every variant against the batch reference on its window).

``streaming_sda(variant, window, ...)`` -> ``SDAStream``: ``reset(B)`` starts B rows (heads
folded into them: one stream's heads, or several streams' rows), ``step(q, k, v)`` with q, k, v
(B, d) -> (B, d), or every window token's output (B, n_t, d), oldest first, when retroactive.
continual and continual_nystrom take their block-level step (models/stream/continual.py,
nystrom.py; one stream of B heads); regular and nystrom recompute the window with the batch
reference (models/sda/reference.py). ``fused``: steady steps in the compiled kernels
(models/fused/kernels.py) on the same state, float32 on the CPU.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from models import flops as F
from models.landmarks import check_landmarks, segment_means
from models.sda.reference import LANDMARK_MODES, VARIANTS, attention, inference, nystrom_attention
from models.stream.continual import RetroactiveState, SingleOutputState, retroactive, single_output
from models.stream.nystrom import Landmarks, NystromState, NystromStep, Token, install
from models.stream.ops import zeros
from models.stream.segments import landmark_event, stream_order
from models.stream.sums import TAU, Stability


def streaming_sda(variant: str, window: int, *, retroactive: bool = False, num_landmarks: int | None = None,
                  landmark_mode: str | None = None, fixed_landmarks=None, pinv_iters: int = 6,
                  stabilize: bool | Stability = True, fused: bool = False) -> "SDAStream":
    """The stream of ``variant`` over a window of ``window`` tokens. Nyström variants take
    ``num_landmarks`` (or ``fixed_landmarks`` (m, d) / (H, m, d), which imply it); landmark_mode
    'fixed' needs ``fixed_landmarks``. ``stabilize``: the stability measures (models/stream/
    sums.py; False or a ``Stability`` only in benchmarks)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    nystrom = variant in ("nystrom", "continual_nystrom")
    if not nystrom:
        if landmark_mode is not None or num_landmarks is not None or fixed_landmarks is not None:
            raise ValueError(f"variant {variant!r} takes no landmarks; valid landmark modes: "
                             f"{LANDMARK_MODES[variant]}")
    else:
        if num_landmarks is None and fixed_landmarks is not None:
            num_landmarks = fixed_landmarks[0].shape[-2]
        if num_landmarks is None:
            raise ValueError(f"variant {variant!r} needs num_landmarks (1 <= m <= {window})")
        check_landmarks(window, num_landmarks)
        landmark_mode = landmark_mode or LANDMARK_MODES[variant][0]
        if landmark_mode not in LANDMARK_MODES[variant]:
            raise ValueError(f"unknown landmark mode {landmark_mode!r} for {variant!r}; valid: "
                             f"{LANDMARK_MODES[variant]}")
        if landmark_mode == "fixed" and fixed_landmarks is None:
            raise ValueError("landmark_mode 'fixed' needs fixed_landmarks=(q_land, k_land); "
                             "fit them with models.landmarks.fit_fixed_landmarks")
        if fixed_landmarks is not None:
            ql, kl = fixed_landmarks
            if ql.dim() not in (2, 3) or ql.shape != kl.shape or ql.shape[-2] != num_landmarks:
                raise ValueError(f"fixed landmarks must be two tensors of shape (m={num_landmarks}, d) or "
                                 f"(H, m, d); got {tuple(ql.shape)} and {tuple(kl.shape)}")
    return SDAStream(variant, window, retroactive, num_landmarks, landmark_mode, fixed_landmarks, pinv_iters,
                     Stability.of(stabilize), fused)


class SDAStream:
    def __init__(self, variant, n, retro, m, mode, fixed, iters, stability, fused):
        self.variant, self.n, self.retroactive, self.m, self.mode = variant, n, bool(retro), m, mode
        self.fixed, self.iters, self.stability, self.fused = fixed, iters, stability, fused
        self.t, self.B, self.d = 0, 0, 0
        self.arrays = None                               # the compiled path's views of the state
        self.call = None                                 # and its kernels (models/fused/numba_cache.Calls)
        self.state: list[Tensor] = []
        self.events = torch.zeros(1, 4, dtype=torch.int64)

    def reset(self, batch_size: int) -> None:
        """Start B rows (the state is made at the first step, for its width, dtype and device)."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.B, self.t, self.d, self.state = batch_size, 0, 0, []

    # ------------------------------------------------------------------ stepping
    def _start(self, q: Tensor) -> None:
        """The first step: the width, dtype and device of the rows; the state."""
        B, d, n, device = self.B, q.shape[-1], self.n, q.device
        self.d, self.dtype, self.device = d, q.dtype, device
        self.slots = torch.arange(n, device=device)
        if self.fixed is not None and self.fixed[0].shape[-1] != d:
            raise ValueError(f"fixed landmarks have d={self.fixed[0].shape[-1]}, inputs have d={d}")
        if self.variant in ("regular", "nystrom"):
            self.state = [torch.zeros(B, n, d, dtype=q.dtype, device=device) for _ in range(3)]
            return
        if self.variant == "continual":
            spec = (RetroactiveState if self.retroactive else SingleOutputState).spec(B, n, d)
            self.state = [x.to(q.dtype) for x in zeros(spec, 1, device)]
            return
        self._start_nystrom_step()
        spec = NystromState.spec(B, n, d, self.m, self.stability.wide)
        self.state = [x.to(q.dtype) if x.is_floating_point() and x.dtype != torch.float64 else x
                      for x in zeros(spec, 1, device)]
        self.p = torch.zeros(1, B, n, self.m, dtype=q.dtype, device=device) if self.retroactive else None

    def _start_nystrom_step(self) -> None:
        """The continual Nyström step for the current mode (fixed: its landmarks installed)."""
        fixed = None
        if self.mode == "fixed":
            ql, kl = (self._rows(x.to(self.device, self.dtype)) for x in self.fixed)
            if ql.shape[-1] != self.d:
                raise ValueError(f"fixed landmarks have d={ql.shape[-1]}, inputs have d={self.d}")
            fixed = Landmarks(*(x.contiguous() for x in install(ql.unsqueeze(0), kl.unsqueeze(0), self.iters)))
        self.step_fn = NystromStep(self.n, self.m, self.iters, self.mode, fixed=fixed, retroactive=self.retroactive,
                                   stability=self.stability).to(self.device)

    def _rows(self, x: Tensor) -> Tensor:
        """Fixed landmarks (m, d) or (H, m, d) -> one set per row (B, m, d)."""
        if x.dim() == 2:
            return x.unsqueeze(0).expand(self.B, -1, -1)
        if x.dim() != 3 or self.B % x.shape[0]:
            raise ValueError(f"fixed landmarks for {x.shape[0]} heads do not divide batch {self.B}")
        return x.repeat(self.B // x.shape[0], 1, 1)

    def _check(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        d = self.d or (q.shape[-1] if isinstance(q, Tensor) and q.dim() == 2 else "d")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[0] != self.B or x.shape[1] != d:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name} must have shape ({self.B}, {d}), got {got}")
            if not x.is_floating_point():
                raise ValueError(f"{name} must be floating point, got {x.dtype}")
        if not q.dtype == k.dtype == v.dtype:
            raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if self.d and (q.dtype != self.dtype or q.device != self.device):
            raise ValueError(f"q is {q.dtype} on {q.device}; the stream started {self.dtype} on {self.device}")

    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q, k, v: (B, d) newest token -> (B, d), or (B, n_t, d) oldest first (retroactive)."""
        if not self.B:
            raise RuntimeError("SDAStream.step called before reset(batch_size)")
        if self.d and self._fusable(q, k, v):
            return self._fused_step(q, k, v)
        self.arrays = None                               # the torch step makes new state tensors
        return self._step(q, k, v)

    @inference
    def _step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._check(q, k, v)
        if not self.d:
            self._start(q)
        t, n = self.t, self.n
        self.t += 1
        n_t = min(self.t, n)
        position = torch.full((1,), t, dtype=torch.int64, device=q.device)
        order = (torch.arange(n_t, device=q.device) + (self.t - n_t)) % n
        if self.variant in ("regular", "nystrom"):
            for ring, x in zip(self.state, (q, k, v)):
                ring[:, t % n] = x
            qw, kw, vw = (ring[:, order] for ring in self.state)
            if self.variant == "regular":
                out = attention(qw, kw, vw)
            else:
                if self.mode == "fixed":
                    self.marks = tuple(self._rows(x.to(q.device, q.dtype)) for x in self.fixed)
                else:
                    self.marks = (segment_means(qw, min(self.m, n_t)), segment_means(kw, min(self.m, n_t)))
                z = None
                if self.fused and q.dtype == torch.float32 and q.device.type == "cpu":
                    from models.fused.pinv import landmark_pinv          # the compiled pseudo-inverse, same result
                    z = landmark_pinv(*self.marks, self.iters)[0]
                out = nystrom_attention(qw, kw, vw, *self.marks, self.iters, z=z)
            return out if self.retroactive else out[:, -1]
        q1, k1, v1 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)          # one stream of B heads
        if self.variant == "continual":
            if self.retroactive:
                out, state, refreshed, rescaled = retroactive(RetroactiveState(*self.state), position, q1, k1, v1,
                                                             self.slots, "eager", self.stability)
                self.events = torch.stack([refreshed * 0, refreshed * 0, refreshed, rescaled.long()], dim=1)
                self.state = list(state)
                return out[0][:, order]
            out, state = single_output(SingleOutputState(*self.state), position, q1, k1, v1, self.slots)
            self.state = list(state)
            return out[0]
        known = "steady" if self.mode == "fixed" else {0: None, 1: "steady", 2: "replace"}[
            int(landmark_event(np.int64(t), n, self.m))]
        state, self.p, out, self.events = self.step_fn(NystromState(*self.state), self.p, Token(position, q1, k1, v1),
                                                        "eager", known)
        self.state = list(state)
        if not self.retroactive:
            return out[0]
        p, zw = out
        return torch.matmul(p, zw)[0][:, order]

    def set_landmark_mode(self, mode: str, fixed_landmarks=None) -> None:
        """Switch landmark mode, also mid-stream: a continual Nyström stream's state is rebuilt
        for the new landmarks from the window it holds (fixed -> continual: the segment sums
        and landmark slots as if tracked all along), and the next step uses them."""
        if self.m is None:
            raise ValueError(f"variant {self.variant!r} takes no landmarks")
        if mode not in LANDMARK_MODES[self.variant]:
            raise ValueError(f"unknown landmark mode {mode!r} for {self.variant!r}; valid: {LANDMARK_MODES[self.variant]}")
        if fixed_landmarks is not None:
            self.fixed = fixed_landmarks
        if mode == "fixed" and self.fixed is None:
            raise ValueError("landmark_mode 'fixed' needs fixed_landmarks=(q_land, k_land)")
        self.mode = mode
        if self.variant != "continual_nystrom" or not self.d:
            return
        state = [x.clone() for x in self.state]
        self._start_nystrom_step()
        s, seen = NystromState(*state), torch.tensor([self.t], device=self.device)
        if mode == "continual":
            s = self.step_fn.resumed(s, seen)
            marks = (s.q_scaled, s.k_scaled_t, s.z64)
        else:
            marks = self.step_fn.fixed_marks
        s, self.p = self.step_fn.rows_from_scratch(seen, s, self.p, marks)
        self.state, self.arrays = list(s), None

    # ------------------------------------------------------------------ the compiled kernels
    def _fusable(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """A steady step the compiled kernel can take: single-output continual or continual
        Nyström (float64 rows, no landmark change), float32 (B, d) CPU tensors."""
        if not self.fused or self.retroactive or self.variant not in ("continual", "continual_nystrom"):
            return False
        if self.variant == "continual_nystrom":
            if not self.stability.wide or self.t == 0:
                return False
            if self.mode == "continual" and landmark_event(np.int64(self.t), self.n, self.m) != 1:
                return False
        want = (self.B, self.d)
        return all(type(x) is Tensor and x.shape == want and x.dtype == torch.float32 and x.device.type == "cpu"
                   and x.is_contiguous() and not x.requires_grad for x in (q, k, v))

    def _fused_step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from models.fused import kernels
        t = self.t
        self.t += 1
        out = np.empty((self.B, self.d), np.float32)
        if self.call is None:
            from models.fused.numba_cache import Calls
            self.call = Calls()
        if self.arrays is None:
            fixed = None
            if self.variant == "continual_nystrom" and self.mode == "fixed":
                fixed = Landmarks(*(x.numpy() for x in self.step_fn.fixed_marks))
            state = (SingleOutputState if self.variant == "continual" else NystromState)(*self.state)
            config = kernels.Config(period=1, eps=0.0, rescale=self.stability.rescale,        # (no layers here)
                                    refresh=self.stability.refresh, tau=TAU, track=self.mode == "continual",
                                    iters=self.iters)
            self.arrays = (*kernels.arrays(state, fixed), config)
        s, marks, config = self.arrays
        if self.variant == "continual":
            self.call(kernels.attend_single, s, 0, q.numpy(), k.numpy(), v.numpy(), t, out)
            return torch.from_numpy(out)
        rescaled, refreshed = self.call(kernels.nystrom_attend, s, 0, marks, q.numpy(), k.numpy(), v.numpy(), t,
                                        config, out)
        self.events = torch.tensor([[0, 0, refreshed, int(rescaled)]])
        return torch.from_numpy(out)

    # ------------------------------------------------------------------ what the last step did
    def landmarks(self) -> tuple[Tensor, Tensor] | None:
        """(q_land, k_land) (B, m', d) the last step used, oldest segment first, or None."""
        if self.t == 0 or self.variant not in ("nystrom", "continual_nystrom"):
            return None
        if self.variant == "nystrom":
            return self.marks
        if self.mode == "fixed":
            return tuple(self._rows(x.to(self.device, self.dtype)) for x in self.fixed)
        s = NystromState(*self.state)
        if self.t >= self.n:
            return stream_order(s.q_land[0], s.k_land[0], int(s.completed[0]), self.m)
        count = torch.full((1,), self.t, dtype=torch.int64, device=self.device)
        m = min(self.m, self.t)
        return tuple(self.step_fn.segments.means(x, count)[0][0][:, :m] for x in (s.q_ring, s.k_ring))

    @property
    def last_step(self) -> F.Flops:
        """FLOPs of the last step for all B rows."""
        if self.t == 0:
            return F.Flops()
        n_t, d, B, t, n = min(self.t, self.n), self.d, self.B, self.t, self.n
        rebuilt, replaced, refreshed, rescaled = (int(x) for x in self.events[0])
        if self.variant == "regular":
            return B * F.regular_sda(n_t, d)
        if self.variant == "nystrom":
            return B * F.nystrom_sda(n_t, d, self.marks[0].shape[1], self.iters, segment=self.mode == "segment")
        if self.variant == "continual":
            if not self.retroactive:
                return B * F.continual_sda(n_t, d)
            per = F.continual_retroactive_sda(n_t, d, first=t == 1, evict=t > n, stabilize=self.stability.refresh,
                                              rescaled=bool(rescaled))
            return B * per + F.refresh(refreshed, n_t, d)
        continual = self.mode == "continual"
        m = min(self.m, n_t) if continual else self.m
        event = "rebuild" if rebuilt or t == 1 else "landmark" if replaced else "step"
        per = F.continual_nystrom_sda(n_t, d, m, self.iters, event=event, retroactive=self.retroactive,
                                      evict=t > n and event != "rebuild", stabilize=self.stability.refresh,
                                      p_rebuilt=event != "step", warmup_landmarks=bool(rebuilt) and t < n,
                                      segment_sums=continual, rescaled=bool(rescaled))
        return B * per + F.refresh(refreshed, n_t, d)

    @property
    def last_step_flops(self) -> int:
        return self.last_step.total

    @property
    def landmark_updated(self) -> bool:
        return bool(self.events[0, 1])

    def state_nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.state)
