"""Audio -> tokens: VGGish offline for whole files (batched), and any front end streamed one hop
at a time (``TokenStream``; see audio/frontends.py).

Both give identical tokens for the same audio (tested): token t is VGGish applied to the log-mel
patch of the 0.96 s that ends at (t+1) * 0.25 s (see audio/melspec.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .melspec import HOP, SAMPLE_RATE, offline_patches
from .sources import SourceStats, decode_file
from .vggish import Embedder


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


@dataclass
class StreamedToken:
    index: int              # token / hop index t
    audio_time: float       # seconds of audio up to the end of this hop, (t + 1) * 0.25
    token: torch.Tensor     # (1, D)
    mel: np.ndarray         # (k, bands) log-mel frames this hop added
    mel_ms: float           # log-mel time for this hop
    network_ms: float       # front-end network time for this hop
    flops: int = 0          # front-end network FLOPs for this hop
    ready_time: float = 0.0  # time.monotonic() when the hop's last sample was available


class TokenStream:
    """Iterate a hop source into tokens of ``frontend`` (a FrontEnd or a VGGish Embedder), one
    per hop, computing only what each hop changes."""

    def __init__(self, source, frontend):
        from .frontends import as_frontend
        self.source, self.frontend = source, as_frontend(frontend)
        self.state = self.frontend.stream()

    def __iter__(self):
        for t, hop in enumerate(self.source):
            ready = getattr(self.source, "last_ready", None) or time.monotonic()
            h = self.state.push(hop)
            yield StreamedToken(t, (t + 1) * HOP / SAMPLE_RATE, h.token, h.mel, h.mel_ms,
                                h.network_ms, h.flops, ready)
