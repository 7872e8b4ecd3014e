"""GenreTransformer: token stream -> genre logits, with any attention variant.

Linear in_dim -> d_model, recycling positional encoding (position index = t mod T), 1 or 2
post-norm encoder blocks (y = LN(x + MHA(x)); z = LN(y + FF(y))), classifier on the newest token.
With 2 blocks the first is retroactive and the last single-output (Hedegaard et al.).

Call modes (as in the continual-inference library):
  model(x, start=0, landmarks=None)  x: (B, T <= n, in_dim) -> (B, classes), the window's last token
  model.reset(B); model.step(token)  token: (B, in_dim) -> (B, classes), equal to model(window)
``step`` holds the state of B streams and runs the step of models/stream/model.py on it (on the
CPU, its steady steps in the compiled backend of models/fused/); `regular` and `nystrom` models
step by recomputing the window (they are the baselines).
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
from .sda import inference


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
        self._batch: int | None = None
        self._t = 0
        self._steppers: dict = {}          # landmark mode -> its ModelStep (models/stream/model.py)
        self._state: list[Tensor] | None = None
        self._events: Tensor | None = None
        self._backend = None               # the compiled backend over the state (models/fused/)
        self._tokens: Tensor | None = None # recomputing variants: the window's tokens (B, n, in_dim)

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

    def stepper(self, mode: str | None = None):
        """The explicit-state step of this model with landmark ``mode`` (default: its own),
        made once (models/stream/model.py)."""
        from .stream.model import ModelStep
        mode = mode if mode is not None else self.landmark_mode
        if mode not in self._steppers:
            device = self.embed.weight.device
            events = "masked" if device.type == "cuda" else "eager"
            self._steppers[mode] = ModelStep(self, mode, events=events).to(device)
        return self._steppers[mode]

    def reset(self, batch_size: int = 1) -> None:
        """Start ``batch_size`` new streams; must be called before the first ``step``."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self._batch, self._t, self._backend = batch_size, 0, None
        device = self.embed.weight.device
        if not self.continual:
            self._tokens = torch.zeros(batch_size, self.cfg.window, self.cfg.in_dim, device=device,
                                       dtype=self.embed.weight.dtype)
            return
        self._steppers = {}                   # weights or landmarks may have changed since
        step = self.stepper()
        self._state = step.initial(batch_size, device)
        self._events = torch.zeros(batch_size, 4, dtype=torch.int64)
        self._bind_backend()

    def _bind_backend(self) -> None:
        """The compiled backend for this model's steady steps, where it takes them."""
        self._backend = None
        if self.fused:
            from .fused.backend import backend
            self._backend = backend(self.stepper())
            if self._backend is not None:
                self._rows, self._positions = np.arange(self._batch), np.zeros(self._batch, np.int64)

    def step(self, token: Tensor) -> Tensor:
        """token: (B, in_dim) -> logits (B, classes) of the window ending at this token."""
        if self._batch is None:
            raise RuntimeError("GenreTransformer.step called before reset(batch_size)")
        t, backend = self._t, self._backend
        if (backend is not None and type(token) is Tensor and token.dtype == torch.float32
                and token.device.type == "cpu" and token.shape == (self._batch, self.cfg.in_dim)
                and token.is_contiguous() and not token.requires_grad and backend.steady_at(t)):
            d = self.__dict__                 # (nn.Module.__setattr__ costs microseconds here)
            d["_t"] = t + 1
            self._positions[:] = t
            logits, d["_events"] = backend.step(token, self._rows, self._positions, self._state)
            return logits
        return self._step(token, t)

    @inference
    def _step(self, token: Tensor, t: int) -> Tensor:
        self._check_input(token, 2)
        if token.shape[0] != self._batch:
            raise ValueError(f"token batch {token.shape[0]} != reset batch {self._batch}")
        self._t = t + 1
        n = self.cfg.window
        if not self.continual:                       # baseline: recompute the whole window
            self._tokens[:, t % n] = token
            n_t = min(t + 1, n)
            order = (torch.arange(n_t, device=token.device) + (t + 1 - n_t)) % n
            return self.forward(self._tokens[:, order], start=(t + 1 - n_t) % self.cfg.period)
        step = self.stepper()
        step.known = known_event(self.cfg, self.landmark_mode, t)
        positions = torch.full((self._batch,), t, dtype=torch.int64, device=token.device)
        logits, events, *state = step(token, positions, *self._state)
        self._state, self._events = state, events
        return logits

    def landmarks(self) -> list | None:
        """Per block, the folded landmarks (B * heads, m', d_head) the last step used
        (continual_nystrom), else None."""
        if self.cfg.variant != "continual_nystrom" or self._state is None or self._t == 0:
            return None
        from .stream.model import stream_landmarks
        return stream_landmarks(self.stepper(), self._state, self._t)

    def landmark_updated(self) -> bool:
        """True if the last step installed a new continual landmark."""
        return self.continual and self._events is not None and bool(self._events[:, 1].any())

    def window_full(self) -> bool:
        """Whether the last step's window held n tokens (past warm-up)."""
        return self._t >= self.cfg.window

    def window_start(self) -> int:
        """Position index of the oldest token of the current window (for ``forward(start=...)``)."""
        return (self._t - min(self._t, self.cfg.window)) % self.cfg.period

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
        before = self.landmark_mode
        for block in self.blocks:
            block.attn.set_landmark_mode(mode)
        if not self.continual or self._state is None or mode == before:
            return
        self._steppers.pop(mode, None)        # fixed landmarks may be newly fitted
        step = self.stepper(mode)
        positions = torch.full((self._batch,), self._t, dtype=torch.int64, device=self._state[0].device)
        with torch.no_grad():
            self._state = step.switched_from(self._state, positions)
        self._bind_backend()

    def state_nbytes(self) -> int:
        """Bytes of streaming state (rings, cached sums, landmarks) for the current batch."""
        held = self._state or ([self._tokens] if self._tokens is not None else [])
        return sum(x.numel() * x.element_size() for x in held)

    def step_flops(self) -> dict[str, int]:
        """FLOPs of the last step for one stream: 'sda', 'attention' (with projections), 'model'."""
        return {k: v.total for k, v in self.step_flops_detail().items()}

    def step_flops_detail(self) -> dict[str, F.Flops]:
        """Like ``step_flops`` with the matrix-product part separate (see models/flops.py)."""
        cfg = self.cfg
        if not self.continual:                       # full recomputation of the window
            return F.recompute_step(cfg, min(self._t, cfg.window), self.landmark_mode)
        return F.graph_step(cfg, self.landmark_mode, self._t, self._events[0].tolist())


def known_event(cfg, mode: str | None, t: int) -> str | None:
    """What the step at position t does, from the position alone (continual landmarks: warm-up
    None, "steady", or "replace"; others "steady"): the branch the step needs to compute."""
    if mode != "continual":
        return "steady"
    from .stream.segments import landmark_event
    return {0: None, 1: "steady", 2: "replace"}[int(landmark_event(np.int64(t), cfg.window, cfg.num_landmarks))]


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
