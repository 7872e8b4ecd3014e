"""Interleaved streams: run a model trained on tokens s hops apart on a stream with one token
per hop, and still answer every hop.

Replica r (of s, same weights) is fed the tokens of hops r, r + s, r + 2s, ...; each hop steps
exactly one replica and returns its logits. Every replica therefore sees tokens at the spacing the
model was trained on, and a prediction comes every hop from the replica fed last. The wrapper has
the streaming interface of GenreTransformer (reset / step / step_flops / state_nbytes /
set_landmark_mode / landmark_updated); ``primary`` is replica 0, whose weights (and any fitted
landmarks) the others copy.
"""
from __future__ import annotations

import copy

from torch import Tensor, nn


class InterleavedStreams(nn.Module):
    def __init__(self, model: nn.Module, spacing: int):
        super().__init__()
        if spacing < 1:
            raise ValueError(f"spacing must be >= 1 hop, got {spacing}")
        self.spacing = spacing
        self.replicas = nn.ModuleList([model] + [copy.deepcopy(model) for _ in range(spacing - 1)])
        self._hop = 0
        self._last = model

    @property
    def primary(self) -> nn.Module:
        return self.replicas[0]

    @property
    def cfg(self):
        return self.primary.cfg

    @property
    def landmark_mode(self):
        return self.primary.landmark_mode

    @property
    def has_fixed_landmarks(self) -> bool:
        return self.primary.has_fixed_landmarks

    @property
    def switchable(self) -> bool:
        """Whether the landmark mode can be switched (not for an exported graph)."""
        return getattr(self.primary, "switchable", True)

    @property
    def embed(self):
        return self.primary.embed

    @property
    def blocks(self):
        return self.primary.blocks

    def forward(self, x: Tensor, start=0, landmarks=None) -> Tensor:
        """Batch forward of the shared weights: x (B, T, in_dim) -> (B, classes)."""
        return self.primary(x, start=start, landmarks=landmarks)

    def use_fused(self, on: bool = True) -> "InterleavedStreams":
        for r in self.replicas:
            r.use_fused(on)
        return self

    def reset(self, batch_size: int = 1) -> None:
        self._hop = 0
        for r in self.replicas:
            r.reset(batch_size)

    def step(self, token: Tensor) -> Tensor:
        """token: (B, in_dim) of this hop -> logits (B, classes) of the replica it was fed to."""
        self._last = self.replicas[self._hop % self.spacing]
        self._hop += 1
        return self._last.step(token)

    def step_flops(self) -> dict[str, int]:
        return self._last.step_flops()

    def step_flops_detail(self):
        return self._last.step_flops_detail()

    def landmark_updated(self) -> bool:
        return self._last.landmark_updated()

    def window_full(self) -> bool:
        return self._last.window_full()

    def landmarks(self):
        return self._last.landmarks()

    def state_nbytes(self) -> int:
        return sum(r.state_nbytes() for r in self.replicas)

    def set_landmark_mode(self, mode: str) -> None:
        """Copy the primary's weights and landmarks to every replica, then switch them all."""
        state = self.primary.state_dict()
        for r in self.replicas:
            if r is not self.primary:
                r.load_state_dict(state)
            r.set_landmark_mode(mode)
