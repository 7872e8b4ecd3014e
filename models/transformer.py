"""GenreTransformer: token stream -> genre logits, with any attention variant.

Linear in_dim -> d_model, recycling positional encoding (position index = t mod T), 1 or 2
post-norm encoder blocks (y = LN(x + MHA(x)); z = LN(y + FF(y))), classifier on the newest token.
With 2 blocks the first is retroactive and the last single-output (Hedegaard et al.).

Call modes (as in the continual-inference library):
  model(x, start=0, landmarks=None)  x: (B, T <= n, in_dim) -> (B, classes), the window's last token
  model.reset(B); model.step(token)  token: (B, in_dim) -> (B, classes), equal to model(window)
``reset`` starts B streams as the slots of a models/stream/batch.StreamBatch, the one holder of
streaming state: continual models run the step of models/stream/model.py (on the CPU, its steady
steps in the compiled backend of models/fused/); `regular` and `nystrom` models step by
recomputing the window (they are the baselines).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as nnf

import numpy as np

from . import flops as F
from .config import ModelConfig
from .mha import MultiheadAttention


class RecyclingPositionalEncoding(nn.Module):
    """Adds embedding[(start + i) mod T] to token i. x: (B, L, d)."""

    def __init__(self, period: int, d: int, kind: str):
        super().__init__()
        self.period = period
        if kind == "learned":
            self.table = nn.Parameter(torch.randn(period, d) * 0.02)
        else:
            pos = torch.arange(period).unsqueeze(1)
            div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
            table = torch.zeros(period, d)
            table[:, 0::2] = torch.sin(pos * div)
            table[:, 1::2] = torch.cos(pos * div)[:, : d // 2]
            self.register_buffer("table", table)

    def forward(self, x: Tensor, start: int | Tensor = 0) -> Tensor:
        L = x.shape[1]
        if isinstance(start, Tensor):     # (B,) random start per sequence (training)
            idx = (start.unsqueeze(1) + torch.arange(L, device=x.device)) % self.period
            return x + self.table[idx]
        idx = (start + torch.arange(L, device=x.device)) % self.period
        return x + self.table[idx]


class EncoderLayer(nn.Module):
    """Post-norm encoder block: y = LN(x + MHA(x)); z = LN(y + FF(y))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.attn = MultiheadAttention(cfg.d_model, cfg.heads, cfg.window, cfg.variant,
                                       num_landmarks=cfg.num_landmarks if cfg.nystrom else None,
                                       landmark_mode=cfg.home_landmark_mode, pinv_iters=cfg.pinv_iters)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, cfg.ff_dim), nn.ReLU(),
                                nn.Linear(cfg.ff_dim, cfg.d_model))
        self.drop1 = nn.Dropout(cfg.dropout)
        self.drop2 = nn.Dropout(cfg.dropout)

    def _tail(self, x: Tensor, a: Tensor) -> Tensor:
        """Residual, LayerNorm, feed-forward, residual, LayerNorm. x, a: (..., d)."""
        if self.training:
            y = self.norm1(x + self.drop1(a))
            return self.norm2(y + self.drop2(self.ff(y)))
        # inference: the same arithmetic without module-call overhead (this is the step hot path)
        d = (x.shape[-1],)
        n1, n2, f1, f2 = self.norm1, self.norm2, self.ff[0], self.ff[2]
        y = nnf.layer_norm(x + a, d, n1.weight, n1.bias, n1.eps)
        h = nnf.linear(nnf.relu(nnf.linear(y, f1.weight, f1.bias)), f2.weight, f2.bias)
        return nnf.layer_norm(y + h, d, n2.weight, n2.bias, n2.eps)

    def forward(self, x: Tensor, landmarks=None) -> Tensor:
        """x: (B, T, d) -> (B, T, d), every token of the window."""
        return self._tail(x, self.attn(x, landmarks))


class GenreTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.in_dim, cfg.d_model)
        self.pos = RecyclingPositionalEncoding(cfg.period, cfg.d_model, cfg.pos_encoding)
        self.blocks = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        self.continual = cfg.variant in ("continual", "continual_nystrom")
        self.fused = False                 # steady steps in the compiled CPU backend (use_fused)
        self.streams = None                # the streams ``reset`` started (a StreamBatch)

    # ------------------------------------------------------------------ batch
    def forward(self, x: Tensor, start: int | Tensor = 0, landmarks: list | None = None) -> Tensor:
        """x: (B, T <= n, in_dim) -> logits (B, classes) of the last token.

        start: position index of x[:, 0] (int, or (B,) tensor); landmarks: optional per-block list
        of folded (q_land, k_land) pairs, e.g. ``model.landmarks()`` of a stream.
        """
        self._check_input(x, 3)
        if x.shape[1] > self.cfg.window:
            raise ValueError(f"x has {x.shape[1]} tokens; the window holds at most {self.cfg.window}")
        h = self.pos(self.embed(x), start)
        for i, block in enumerate(self.blocks):
            h = block(h, landmarks[i] if landmarks is not None else None)
        return self.head(h[:, -1])

    def _check_input(self, x: Tensor, dims: int) -> None:
        want = "(B, T, {})" if dims == 3 else "(B, {})"
        if not isinstance(x, Tensor) or x.dim() != dims or x.shape[-1] != self.cfg.in_dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"expected input of shape {want.format(self.cfg.in_dim)}, got {got}")
        p = self.embed.weight
        if x.dtype != p.dtype or x.device != p.device:
            raise ValueError(f"input is {x.dtype} on {x.device}; the model is {p.dtype} on {p.device}")

    # ------------------------------------------------------------------ streaming
    def use_fused(self, on: bool = True) -> "GenreTransformer":
        """Take steady streaming steps in the compiled CPU backend (models/fused/), or only the
        torch step. Continual variants, float32 on the CPU; the recomputing ``nystrom``'s
        pseudo-inverse is compiled too (in inference). Equal to the torch step within float32
        rounding (tests/models/test_fused.py). Takes effect at the next reset."""
        from .fused import available
        self.fused = bool(on) and available()
        for block in self.blocks:
            block.attn.compiled_pinv = self.fused
        return self

    def reset(self, batch_size: int = 1) -> None:
        """Start ``batch_size`` new streams; must be called before the first ``step``. They are
        the slots of a models/stream/batch.StreamBatch (``streams``), which holds their state."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        from .stream.batch import StreamBatch
        p = self.embed.weight
        self.streams = StreamBatch(self, batch_size, fused=self.fused, graphs=False)
        self._slots = np.array([self.streams.join() for _ in range(batch_size)], np.int64)
        self._expect = (batch_size, self.cfg.in_dim, p.dtype, p.is_cuda)

    def step(self, token: Tensor) -> Tensor:
        """token: (B, in_dim) -> logits (B, classes) of the window ending at this token."""
        if self.streams is None:
            raise RuntimeError("GenreTransformer.step called before reset(batch_size)")
        B, I, dtype, cuda = self._expect
        if type(token) is not Tensor or token.shape != (B, I) or token.dtype != dtype or token.is_cuda != cuda:
            self._check_input(token, 2)
            raise ValueError(f"token batch {token.shape[0]} != reset batch {B}")
        return self.streams.step(self._slots, token)

    @property
    def events(self) -> Tensor:
        """(B, 4) the last step's events (models/stream/model.py: rebuilt, replaced, rows
        refreshed, rescaled; zeros for the recomputing variants)."""
        if not self.continual or len(self.streams.stepped) == 0:
            return torch.zeros(len(self._slots), 4, dtype=torch.int64)
        return torch.from_numpy(self.streams.events_host())

    @property
    def seen(self) -> int:
        """Tokens the streams have taken since ``reset``."""
        return 0 if self.streams is None else int(self.streams.positions[self._slots[0]])

    def landmarks(self) -> list | None:
        """Per block, the folded landmarks (B * heads, m', d_head) the last step used
        (continual_nystrom), else None."""
        if self.cfg.variant != "continual_nystrom" or self.streams is None or self.seen == 0:
            return None
        from .stream.model import stream_landmarks
        state = [x[self._slots[0]:self._slots[-1] + 1] for x in self.streams.state]
        return stream_landmarks(self.streams.stepper, state, self.seen)

    def landmark_updated(self) -> bool:
        """True if the last step installed a new continual landmark."""
        return self.streams is not None and len(self.streams.stepped) > 0 and any(self.streams.landmark_updates())

    def window_full(self) -> bool:
        """Whether the last step's window held n tokens (past warm-up)."""
        return self.seen >= self.cfg.window

    def window_start(self) -> int:
        """Position index of the oldest token of the current window (for ``forward(start=...)``)."""
        return (self.seen - min(self.seen, self.cfg.window)) % self.cfg.period

    @property
    def landmark_mode(self) -> str | None:
        """The landmark mode in use ('segment' / 'continual' / 'fixed'), None without landmarks."""
        return self.blocks[0].attn.landmark_mode

    @property
    def has_fixed_landmarks(self) -> bool:
        return self.cfg.nystrom and all(b.attn.fixed_fitted for b in self.blocks)

    def set_landmark_mode(self, mode: str) -> None:
        """Switch every block between 'continual'/'segment' and 'fixed' landmarks, also
        mid-stream: the streams' state is rebuilt for the new landmarks from the window it holds
        (``ModelStep.switched_from``), and the next step uses them."""
        for block in self.blocks:
            block.attn.set_landmark_mode(mode)
        if self.streams is not None:
            self.streams.set_landmark_mode(mode)

    def state_nbytes(self) -> int:
        """Bytes of streaming state (rings, cached sums, landmarks) for the current batch."""
        return 0 if self.streams is None else self.streams.slot_nbytes * len(self._slots)

    def step_flops(self) -> dict[str, int]:
        """FLOPs of the last step for one stream: 'sda', 'attention' (with projections), 'model'."""
        return {k: v.total for k, v in self.step_flops_detail().items()}

    def step_flops_detail(self) -> dict[str, F.Flops]:
        """Like ``step_flops`` with the matrix-product part separate (see models/flops.py)."""
        cfg, t = self.cfg, self.seen
        if not self.continual:                       # full recomputation of the window
            return F.recompute_step(cfg, min(t, cfg.window), self.landmark_mode)
        return F.graph_step(cfg, self.landmark_mode, t, self.events[0].tolist())


def build_model(cfg: ModelConfig, *, seed: int | None = None, fused: bool = True) -> GenreTransformer:
    """A randomly initialised GenreTransformer for ``cfg``; with ``seed``, the same weights
    every time, drawn from a private generator state (the global RNG is left as it was). It
    steps in the fused CPU kernel where that applies (continual variants, float32 on the CPU;
    elsewhere, or with ``fused=False``, the torch reference path; ``use_fused`` switches later).

    A config with landmark_mode 'fixed' needs its fixed landmarks from a checkpoint's state dict
    or ``models.landmarks.fit_fixed_landmarks`` before it runs."""
    if seed is None:
        return GenreTransformer(cfg).use_fused(fused)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GenreTransformer(cfg).use_fused(fused)
