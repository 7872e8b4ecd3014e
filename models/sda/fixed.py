"""Landmark modes of the Nyström kernels and their fixed (k-means) landmarks."""
from __future__ import annotations

from torch import Tensor

from ..landmarks import check_landmarks
from .reference import LANDMARK_MODES


def init_landmarks(kernel, m: int, mode: str, fixed_landmarks, pinv_iters: int) -> None:
    """Set up a Nyström kernel's landmarks: m of them, starting in ``mode``."""
    check_landmarks(kernel.n, m)
    kernel.m, kernel.pinv_iters = m, pinv_iters
    kernel.fixed, kernel.mode = None, LANDMARK_MODES[kernel.variant][0]
    kernel.set_landmark_mode(mode, fixed_landmarks)


def check_mode(kernel, mode: str, fixed_landmarks: tuple[Tensor, Tensor] | None):
    """Validate ``mode`` for ``kernel`` and return the fixed landmarks it will use (or keep)."""
    valid = LANDMARK_MODES[kernel.variant]
    if mode not in valid:
        raise ValueError(f"unknown landmark mode {mode!r} for {kernel.variant!r}; valid: {valid}")
    fixed = kernel.fixed
    if fixed_landmarks is not None:
        ql, kl = fixed_landmarks
        if ql.dim() not in (2, 3) or ql.shape != kl.shape or ql.shape[-2] != kernel.m:
            raise ValueError(f"fixed landmarks must be two tensors of shape (m={kernel.m}, d) or "
                             f"(H, m, d); got {tuple(ql.shape)} and {tuple(kl.shape)}")
        fixed = (ql.detach(), kl.detach())
    if mode == "fixed" and fixed is None:
        raise ValueError("landmark_mode 'fixed' needs fixed_landmarks=(q_land, k_land); "
                         "fit them with models.landmarks.fit_fixed_landmarks")
    return fixed


def expand_fixed(kernel) -> tuple[Tensor, Tensor]:
    """The fixed landmarks, one set per folded batch row: (B, m, d) x 2, in the stream's dtype."""
    ql, kl = kernel.fixed
    B = kernel._batch
    if ql.dim() == 2:
        ql, kl = ql.unsqueeze(0), kl.unsqueeze(0)
    if B % ql.shape[0]:
        raise ValueError(f"fixed landmarks for {ql.shape[0]} heads do not divide batch {B}")
    reps = B // ql.shape[0]
    cast = dict(device=kernel._device, dtype=kernel._dtype)
    return ql.to(**cast).repeat(reps, 1, 1), kl.to(**cast).repeat(reps, 1, 1)


def check_fixed_dim(kernel, d: int) -> None:
    if kernel.fixed is not None and kernel.mode == "fixed" and kernel.fixed[0].shape[-1] != d:
        raise ValueError(f"fixed landmarks have d={kernel.fixed[0].shape[-1]}, inputs have d={d}")
