"""Scaled dot-product attention over a window, the batch references (heads folded into the
batch, (B, n, d)):

  regular            softmax attention, recomputed over the whole window each step
  continual          equal to regular; streamed by models/stream/continual.py
  nystrom            Nyström attention over the window; landmarks 'segment' (segment means of the
                     window) or 'fixed' (k-means, models/landmarks.py)
  continual_nystrom  equal to nystrom given the same landmarks; streamed by
                     models/stream/nystrom.py, landmarks 'continual' or 'fixed'

These are what training and the recomputing variants run, and the oracles every streaming step
is tested against (tests/models).
"""
from __future__ import annotations

from ..landmarks import segment_means
from .reference import (LANDMARK_MODES, VARIANTS, attention, inference, landmark_pinv,
                        nystrom_attention, pinv)

__all__ = ["attention", "nystrom_attention", "pinv", "landmark_pinv", "segment_means", "VARIANTS",
           "LANDMARK_MODES", "inference"]
