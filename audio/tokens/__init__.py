"""Audio -> tokens: VGGish offline for whole files (batched); streamed one hop at a time, any
front end, in audio/tokens/stream.py.

Both give identical tokens for the same audio (tested): token t is VGGish applied to the log-mel
patch of the 0.96 s that ends at (t+1) * 0.25 s (see audio/melspec.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..melspec import offline_patches
from ..decoding import SourceStats, decode_file
from ..vggish import Embedder


def tokens_for_file(path: str | Path, embedder: Embedder, batch_size: int = 64) -> tuple[torch.Tensor, dict]:
    """(T, 128) float32 tokens of a whole file (T = complete 0.25 s hops), and decode info."""
    stats = SourceStats()
    signal, info = decode_file(path, stats)
    return tokens_for_signal(signal, embedder, batch_size), {**info, "nonfinite": stats.nonfinite,
                                                             "clipped": stats.clipped}


def tokens_for_signal(signal: np.ndarray, embedder: Embedder, batch_size: int = 64) -> torch.Tensor:
    """(samples,) 16 kHz mono -> (T, 128) float32 tokens."""
    patches = offline_patches(signal)
    if len(patches) == 0:
        return torch.zeros(0, 128)
    return torch.cat([embedder(patches[i:i + batch_size]) for i in range(0, len(patches), batch_size)])
