"""Scaled dot-product attention: batch references and one streaming kernel per variant.

  regular            recompute softmax attention over the window each step (baseline)
  continual          Continual Single-Output / Retroactive SDA (Hedegaard et al.), exact
  nystrom            recompute Nyström attention over the window each step (baseline);
                     landmarks 'segment' (segment means of the window) or 'fixed'
  continual_nystrom  Continual Nyström SDA (Carreto Picón et al.); landmarks 'continual'
                     (stream-aligned segment means, see models/landmarks.py) or 'fixed'

Every kernel answers from the first token (the window holds the newest min(t, n) tokens) and
equals its batch reference on that window at every step (tests/models). Continual sums are
stabilised as explained in models/running_sums.py, so scores far beyond float32's exp range stay
finite. The shared contract is in models/sda/kernel.py.
"""
from __future__ import annotations

from ..landmarks import segment_means
from ..running_sums import Stability
from .continual import ContinualKernel
from .continual_nystrom import ContinualNystromKernel
from .kernel import SDAKernel, StepReport
from .recompute import NystromKernel, RegularKernel
from .reference import (LANDMARK_MODES, VARIANTS, attention, inference, landmark_pinv,
                        nystrom_attention, pinv)

KERNELS = {"regular": RegularKernel, "continual": ContinualKernel, "nystrom": NystromKernel,
           "continual_nystrom": ContinualNystromKernel}


def streaming_sda(variant: str, window: int, *, retroactive: bool = False,
                  num_landmarks: int | None = None, landmark_mode: str | None = None,
                  fixed_landmarks=None, pinv_iters: int = 6, stabilize: bool | Stability = True,
                  fused: bool = False) -> SDAKernel:
    """The streaming kernel of ``variant`` over a window of ``window`` tokens.

    ``retroactive``: every step returns the whole window's outputs; ``stabilize=False`` turns off
    the overflow/cancellation/drift protection, or a ``Stability`` some of it (benchmarks only);
    ``fused``: steady steps in the compiled CPU kernel (models/fused/). Nyström variants need
    ``num_landmarks`` (or ``fixed_landmarks`` (m, d) / (H, m, d), which imply it).
    """
    if variant not in KERNELS:
        raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
    kernel = KERNELS[variant]
    common = dict(retroactive=retroactive, stabilize=stabilize, fused=fused)
    if not kernel.takes_landmarks:
        if landmark_mode is not None or num_landmarks is not None or fixed_landmarks is not None:
            raise ValueError(f"variant {variant!r} takes no landmarks; valid landmark modes: "
                             f"{LANDMARK_MODES[variant]}")
        return kernel(window, **common)
    if num_landmarks is None and fixed_landmarks is not None:
        num_landmarks = fixed_landmarks[0].shape[-2]
    if num_landmarks is None:
        raise ValueError(f"variant {variant!r} needs num_landmarks (1 <= m <= {window})")
    return kernel(window, num_landmarks=num_landmarks,
                  landmark_mode=landmark_mode or LANDMARK_MODES[variant][0],
                  fixed_landmarks=fixed_landmarks, pinv_iters=pinv_iters, **common)


__all__ = ["attention", "nystrom_attention", "pinv", "landmark_pinv", "segment_means",
           "streaming_sda", "SDAKernel", "StepReport", "KERNELS", "VARIANTS", "LANDMARK_MODES",
           "inference"]
