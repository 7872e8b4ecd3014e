"""A hop source turned into tokens of a front end, one per hop (the live path)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..frontends import as_frontend
from ..melspec import HOP, SAMPLE_RATE


@dataclass
class StreamedToken:
    index: int              # token / hop index t
    audio_time: float       # seconds of the stream's audio up to the end of this hop, dropped hops
                            # included ((t + 1) * 0.25 when none was dropped)
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
        self.source, self.frontend = source, as_frontend(frontend)
        self.state = self.frontend.stream()

    def __iter__(self):
        stats = getattr(self.source, "stats", None)
        for t, hop in enumerate(self.source):
            ready = getattr(self.source, "last_ready", None) or time.monotonic()
            h = self.state.push(hop)
            hops = t + 1 + (stats.dropped if stats is not None else 0)     # the stream's own clock
            yield StreamedToken(t, hops * HOP / SAMPLE_RATE, h.token, h.mel, h.mel_ms,
                                h.network_ms, h.flops, ready)
