"""GenreTransformer: token stream -> genre logits, with any attention variant.

Linear in_dim -> d_model, recycling positional encoding (position index = t mod T), 1 or 2
post-norm encoder blocks (y = LN(x + MHA(x)); z = LN(y + FF(y))), classifier on the newest token.
With 2 blocks the first is retroactive and the last single-output (Hedegaard et al.).

Call modes (as in the continual-inference library, without positional state tuples):
  model(x, start=0, landmarks=None)  x: (B, T <= n, in_dim) -> (B, classes), the window's last token
  model.reset(B); model.step(token)  token: (B, in_dim) -> (B, classes), equal to model(window)
`regular` and `nystrom` models step by recomputing the window (they are the baselines).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as nnf

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

    def __init__(self, cfg: ModelConfig, retroactive: bool, window_input: bool):
        super().__init__()
        self.cfg = cfg
        self.attn = MultiheadAttention(cfg.d_model, cfg.heads, cfg.window, cfg.variant,
                                       num_landmarks=cfg.num_landmarks if cfg.nystrom else None,
                                       landmark_mode=cfg.home_landmark_mode, pinv_iters=cfg.pinv_iters,
                                       retroactive=retroactive, window_input=window_input)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, cfg.ff_dim), nn.ReLU(),
                                nn.Linear(cfg.ff_dim, cfg.d_model))
        self.drop1 = nn.Dropout(cfg.dropout)
        self.drop2 = nn.Dropout(cfg.dropout)
        self.retroactive, self.window_input = retroactive, window_input
        self._x: Tensor | None = None   # (B, n, d) ring of inputs (retroactive residuals)
        self._t = 0

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

    def reset(self, batch_size: int) -> None:
        self.attn.reset(batch_size)
        self._x, self._t = None, 0

    def step(self, x: Tensor) -> Tensor:
        """Streamed token x: (B, d) -> (B, d) single-output or (B, n_t, d) retroactive."""
        a = self.attn.step(x)
        if not self.retroactive:
            return self._tail(x, a)
        n = self.cfg.window
        if self._x is None:
            self._x = x.new_zeros(x.shape[0], n, x.shape[1])
        self._x[:, self._t % n] = x
        self._t += 1
        n_t = min(self._t, n)
        order = (torch.arange(n_t, device=x.device) + (self._t - n_t)) % n
        return self._tail(self._x[:, order], a)

    def step_window(self, xw: Tensor) -> Tensor:
        """Window from a retroactive layer xw: (B, n_t, d) -> newest token (B, d)."""
        return self._tail(xw[:, -1], self.attn.step_window(xw))


class GenreTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.in_dim, cfg.d_model)
        self.pos = RecyclingPositionalEncoding(cfg.period, cfg.d_model, cfg.pos_encoding)
        L = cfg.layers
        self.blocks = nn.ModuleList(
            EncoderLayer(cfg, retroactive=(L == 2 and i == 0), window_input=(L == 2 and i == 1))
            for i in range(L))
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)
        self.continual = cfg.variant in ("continual", "continual_nystrom")
        self._batch: int | None = None
        self.fused = False                 # steps in the compiled CPU kernel (use_fused)
        self._fused_step = None

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
        """Take streaming steps in the fused CPU kernel (models/fused/), or the torch reference.

        Continual variants, float32 on the CPU: at batch 1 a 1-block model steps in one compiled
        call and a 2-block one in a few (models/fused/two_block.py); otherwise the attention
        kernels' steady steps and every pseudo-inverse (also the recomputing ``nystrom``'s, in
        inference) are compiled. Equal to the reference
        within 1e-5 at every step (tests/models/test_fused.py). Takes effect at the next reset."""
        from .fused import available
        self.fused = bool(on) and available()
        for block in self.blocks:      # the recomputing variants' pseudo-inverse, compiled too
            block.attn.compiled_pinv = self.fused
        return self

    def reset(self, batch_size: int = 1) -> None:
        """Start new streams; must be called before the first ``step``."""
        self._batch, self._t = batch_size, 0
        self._tokens = None
        for block in self.blocks:
            block.attn.sda.fused = self.fused
            block.reset(batch_size)
        self._fused_step = None
        if self.fused and batch_size == 1:
            from .fused.model_step import fused_model_step
            self._fused_step = fused_model_step(self)

    def step(self, token: Tensor) -> Tensor:
        """token: (B, in_dim) -> logits (B, classes) of the window ending at this token."""
        fused = self._fused_step
        if (fused is not None and type(token) is Tensor and token.shape == fused.token_shape
                and token.dtype == torch.float32 and token.device.type == "cpu"
                and token.is_contiguous()):
            t = self._t
            self.__dict__["_t"] = t + 1     # (nn.Module.__setattr__ costs microseconds here)
            return fused.step(token, t)
        return self._step(token)

    @inference
    def _step(self, token: Tensor) -> Tensor:
        if self._batch is None:
            raise RuntimeError("GenreTransformer.step called before reset(batch_size)")
        self._check_input(token, 2)
        if token.shape[0] != self._batch:
            raise ValueError(f"token batch {token.shape[0]} != reset batch {self._batch}")
        n, t = self.cfg.window, self._t
        self._t += 1
        if self._fused_step is not None:     # an unusual token (non-contiguous): same result
            return self._fused_step.step(token.contiguous(), t)
        if not self.continual:                       # baseline: recompute the whole window
            if self._tokens is None:
                self._tokens = token.new_zeros(self._batch, n, self.cfg.in_dim)
            self._tokens[:, t % n] = token
            n_t = min(t + 1, n)
            order = (torch.arange(n_t, device=token.device) + (t + 1 - n_t)) % n
            return self.forward(self._tokens[:, order], start=(t + 1 - n_t) % self.cfg.period)
        return self._continual_step(token, t)

    @inference
    def _continual_step(self, token: Tensor, t: int) -> Tensor:
        """The torch reference step of a continual model; token: the stream's t-th (0-based)."""
        h = nnf.linear(token, self.embed.weight, self.embed.bias).add_(self.pos.table[t % self.cfg.period])
        if len(self.blocks) == 1:
            h = self.blocks[0].step(h)
        else:
            h = self.blocks[1].step_window(self.blocks[0].step(h))
        return nnf.linear(h, self.head.weight, self.head.bias)

    def landmarks(self) -> list | None:
        """Per block, the folded landmarks the last step used (continual_nystrom), else None."""
        if self.cfg.variant != "continual_nystrom":
            return None
        return [b.attn.landmarks() for b in self.blocks]

    def landmark_updated(self) -> bool:
        """True if the last step installed a new continual landmark in any block."""
        return self.continual and any(b.attn.sda.landmark_updated for b in self.blocks)

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
        """Switch every block between 'continual'/'segment' and 'fixed' landmarks, also mid-stream."""
        for block in self.blocks:
            block.attn.set_landmark_mode(mode)

    def state_nbytes(self) -> int:
        """Bytes of streaming state (caches, rings, landmarks) for the current batch."""
        total = sum(b.attn.state_nbytes() for b in self.blocks)
        total += sum(b._x.numel() * b._x.element_size() for b in self.blocks if b._x is not None)
        if getattr(self, "_tokens", None) is not None:
            total += self._tokens.numel() * self._tokens.element_size()
        return total

    def step_flops(self) -> dict[str, int]:
        """FLOPs of the last step for one stream: 'sda', 'attention' (with projections), 'model'."""
        return {k: v.total for k, v in self.step_flops_detail().items()}

    def step_flops_key(self) -> tuple:
        """Everything ``step_flops_detail`` reads, as a hashable value: two steps with equal keys
        have equal FLOP counts (models/stream/batch.py counts each key once). The position
        matters up to n + 1; each block's SDA by its state's presence, head dimension, landmark
        count and report (models/sda/kernel.py ``last_step``)."""
        def sda_key(sda):
            st = sda.st
            if st is None or st.t == 0:
                return None
            marks = getattr(st, "marks", None)
            return (st.d, None if marks is None else tuple(marks.q.shape), getattr(st, "ring", None) is None,
                    tuple(vars(sda.report).values()))
        return (min(self._t, self.cfg.window + 1), self._batch, self.landmark_mode,
                tuple(sda_key(b.attn.sda) for b in self.blocks))

    def step_flops_detail(self) -> dict[str, F.Flops]:
        """Like ``step_flops`` with the matrix-product part separate (see models/flops.py)."""
        cfg, B = self.cfg, self._batch or 1
        n_t = min(self._t, cfg.window)
        d, L = cfg.d_model, len(self.blocks)
        if not self.continual:                       # full recomputation of the window
            return F.recompute_step(cfg, n_t, self.landmark_mode)
        total = F.Flops()
        for b in self.blocks:
            total = total + b.attn.sda.last_step
        sda = F.Flops(total.matmul // B, total.other // B)
        if L == 1:
            return F.one_block_step(sda, d, cfg.ff_dim, cfg.in_dim, cfg.num_classes)
        # retroactive block (out-proj and tail over n_t tokens), then window-fed block
        marks = self.blocks[1].attn.sda.landmarks()  # with folded keys and values
        first = self.blocks[0].attn.sda          # factored: W_o folded in (mha.py)
        marks0 = getattr(first.st, "marks", None) if getattr(first, "factored", False) else None
        return F.two_block_step(
            sda, n_t, d, cfg.ff_dim, cfg.in_dim, cfg.num_classes, cfg.heads,
            factored=marks0.q.shape[1] if marks0 is not None else 0,
            window_rows=cfg.heads * (marks[0].shape[1] if marks is not None else 1),
            segment_landmarks=min(cfg.num_landmarks, n_t) if self.landmark_mode == "continual" else 0)


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
