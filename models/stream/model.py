"""A continual model's streaming step for S streams, with every piece of state explicit: the one
step that the model's ``step()`` (models/transformer.py), many streams in one batch
(models/stream/batch.py), the ONNX export (app/offline/onnx_export.py) and CUDA graph capture
all run; the compiled CPU backend (models/fused/) takes the same state arrays.

``ModelStep(model).forward(token, t, *state, known=None)`` -> ``(logits, events, *next_state)``:
token (S, in_dim), t (S,) int64 each stream's position, state as ``spec()`` says with a leading
stream axis; ``known``: what every stream's step does where the caller knows it from the
positions (models/stream/nystrom.py ``NystromStep``); logits (S, classes), events (S, 4) int64:
whether the step rebuilt everything (warm-up), replaced a landmark, how many rows it
recomputed, whether a row was rescaled (what its FLOPs depend on, models/flops.graph_step). A
stream at position 0 starts from zeros whatever its state holds.

Embedding, recycling position (t mod T), then block 0's attention: 1 block, single-output
(continual, or continual Nyström); 2 blocks, retroactive (every query of the window updated),
its window of inputs kept for the residuals (``x_ring``), its out-projection and tail over the
window, then block 1 for the newest token over that window (models/stream/window.py). A
retroactive Nyström block's outputs stay factored, P (Z num / den), and W_o folds into the m
rows of each head: G_h = (Z num / den)_h W_o,h^T (m x D), out = [P_1 .. P_H] [G_1; ..; G_H] + b.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as nnf

from .continual import RetroactiveState, SingleOutputState, retroactive, single_output
from .nystrom import FIXED_FIELDS, NystromState, NystromStep, Token, fixed_landmarks
from .segments import stream_order
from .ops import StateTensor, fresh, slot_of, take, zeros
from .sums import Stability
from .window import WindowStep

CONTINUAL = ("continual", "continual_nystrom")
KINDS = ("continual", "continual_nystrom/continual", "continual_nystrom/fixed")


class NotStreamable(ValueError):
    """A model without an explicit-state step (it recomputes its window)."""


def kind_of(cfg, mode: str | None) -> str:
    if cfg.variant not in CONTINUAL:
        raise NotStreamable(f"a {cfg.variant!r} model recomputes its window each step and has no streaming "
                            f"state to export; exportable: continual, continual_nystrom (continual or fixed landmarks)")
    return "continual" if cfg.variant == "continual" else f"continual_nystrom/{mode}"


def state_spec(cfg, kind: str, *, exported: bool = False, wide: bool = True,
               dtype: torch.dtype = torch.float32) -> list[StateTensor]:
    """The state of one stream of a ``cfg`` model of ``kind`` (KINDS) whose weights are
    ``dtype`` (float64: every tensor float64, for references). ``exported``: only what the step
    reads (an exported step cannot switch its landmark mode, so a fixed-landmark file carries
    no window of queries and keys and no segment sums)."""
    H, n, dh, m, two = cfg.heads, cfg.window, cfg.d_model // cfg.heads, cfg.num_landmarks, cfg.layers == 2
    if kind == "continual":
        spec = RetroactiveState.spec(H, n, dh) if two else SingleOutputState.spec(H, n, dh)
    else:
        spec = NystromState.spec(H, n, dh, m, wide)
        if exported and kind.endswith("fixed"):
            spec = [s for s in spec if s.name in FIXED_FIELDS]
        if two:
            spec.append(StateTensor("p", (H, n, m), torch.float32))
    if two:
        spec.append(StateTensor("x_ring", (n, cfg.d_model), torch.float32))
    if dtype != torch.float32:
        spec = [StateTensor(s.name, s.shape, dtype) if s.dtype == torch.float32 else s for s in spec]
    return spec


class ModelStep(nn.Module):
    """The step of ``model`` (a GenreTransformer in eval mode; its weights by reference, not
    copies) with landmark ``mode`` (default: the model's). ``events``: how rare events branch
    (models/stream/ops.py: "eager", "cond" for ONNX, "masked" for CUDA graphs)."""

    def __init__(self, model, mode: str | None = None, *, events: str = "eager",
                 stability: Stability = Stability()):
        super().__init__()
        cfg = model.cfg
        self.mode = (mode or model.landmark_mode) if cfg.nystrom else None
        self.kind = kind_of(cfg, self.mode)
        self.cfg, self.events, self.stability = cfg, events, stability
        self.embed, self.head, self.blocks = model.embed, model.head, model.blocks
        self.table = model.pos.table
        self.n, self.H, self.D = cfg.window, cfg.heads, cfg.d_model
        self.dh = self.D // self.H
        self.two = cfg.layers == 2
        self.register_buffer("slots", torch.arange(self.n))
        self.nystrom = None
        if cfg.variant == "continual_nystrom":
            self.nystrom = NystromStep(self.n, cfg.num_landmarks, cfg.pinv_iters, self.mode,
                                       fixed=self._fixed(0) if self.mode == "fixed" else None,
                                       retroactive=self.two, stability=stability)
        self.window = None
        if self.two:
            attention = ("continual" if cfg.variant == "continual" else
                         "fixed" if self.mode == "fixed" else "landmarks")
            self.window = WindowStep(self.blocks[1].attn, self.n, attention, m=cfg.num_landmarks,
                                     iters=cfg.pinv_iters, fixed=self._fixed(1) if attention == "fixed" else None)

    def _fixed(self, block: int):
        attn = self.blocks[block].attn
        if not attn.fixed_fitted:
            raise ValueError("this model's fixed landmarks are not fitted: load them from a checkpoint or "
                             "run models.landmarks.fit_fixed_landmarks first")
        return fixed_landmarks(attn.fixed_q_land.detach(), attn.fixed_k_land.detach(), attn.pinv_iters)

    def use_inverse(self, inverse) -> "ModelStep":
        """The landmarks' pseudo-inverse for eager steps (nystrom.install's ``inverse``)."""
        for step in (self.nystrom, self.window):
            if step is not None:
                step.inverse = inverse
        return self

    def spec(self) -> list[StateTensor]:
        return state_spec(self.cfg, self.kind, wide=self.stability.wide, dtype=self.embed.weight.dtype)

    def initial(self, streams: int, device=None) -> list[Tensor]:
        """Zeros of every state tensor for ``streams`` streams (a stream starts at t = 0)."""
        return zeros(self.spec(), streams, device)

    # ------------------------------------------------------------------ the step
    def project(self, token: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """token (S, in_dim), t (S,) -> h (S, D) and q, k, v (S, H, dh)."""
        S = token.shape[0]
        h = nnf.linear(token, self.embed.weight, self.embed.bias) + self.table[t % self.table.shape[0]]
        attn = self.blocks[0].attn
        qkv = nnf.linear(h, attn.in_proj.weight, attn.in_proj.bias).view(S, 3, self.H, self.dh)
        return h, qkv[:, 0].clone(), qkv[:, 1].clone(), qkv[:, 2].clone()      # not views of one tensor

    def forward(self, token: Tensor, t: Tensor, *state: Tensor, known: str | None = None):
        h, q, k, v = self.project(token, t)
        block0, p, x_ring = self.named(state)
        zero = t.new_zeros(t.shape)
        if self.nystrom is not None:
            block0, p, a, events = self.nystrom(block0, p, Token(t, q, k, v), self.events, known)
        elif self.two:
            a, block0, refreshed, rescaled = retroactive(block0, t, q, k, v, self.slots, self.events, self.stability)
            events = torch.stack([zero, zero, refreshed, rescaled.to(torch.int64)], dim=1)
        else:
            a, block0 = single_output(block0, t, q, k, v, self.slots, self.events)
            events = torch.stack([zero] * 4, dim=1)
        if not self.two:
            attn = self.blocks[0].attn
            out = nnf.linear(a.reshape(-1, self.D), attn.out_proj.weight, attn.out_proj.bias)
            logits = nnf.linear(self.blocks[0]._tail(h, out), self.head.weight, self.head.bias)
            return (logits, events, *block0)
        here = slot_of(t, self.slots)
        x_ring = torch.where(here.unsqueeze(-1), h.unsqueeze(1), fresh(t, [x_ring], self.events)[0])
        xw = self.blocks[0]._tail(x_ring, self._window_out(a))                 # (S, n, D) ring order
        x_new = take(xw.unsqueeze(1), here).squeeze(1)                           # (S, D)
        a1 = self.window(t, xw, x_new)                                           # (S, H, dh)
        attn1 = self.blocks[1].attn
        out1 = nnf.linear(a1.reshape(-1, self.D), attn1.out_proj.weight, attn1.out_proj.bias)
        logits = nnf.linear(self.blocks[1]._tail(x_new, out1), self.head.weight, self.head.bias)
        return (logits, events, *block0, *([p] if p is not None else []), x_ring)

    def named(self, state) -> tuple:
        """The flat state -> block 0's named state (``NystromState``, ``RetroactiveState`` or
        ``SingleOutputState``), p (retroactive Nyström, else None), x_ring (2 blocks, else None)."""
        state = list(state)
        x_ring = state.pop() if self.two else None
        p = state.pop() if self.two and self.nystrom is not None else None
        kind = NystromState if self.nystrom is not None else RetroactiveState if self.two else SingleOutputState
        return kind(*state), p, x_ring

    def _window_out(self, a) -> Tensor:
        """Block 0's out-projection of every window slot: (S, n, D); a retroactive Nyström
        block's factors (p (S, H, n, m), zw (S, H, m, dh)) with W_o folded into the m rows."""
        attn = self.blocks[0].attn
        if not isinstance(a, tuple):
            S = a.shape[0]
            return nnf.linear(a.transpose(1, 2).reshape(S, self.n, self.D), attn.out_proj.weight, attn.out_proj.bias)
        p, zw = a
        S, m = p.shape[0], p.shape[-1]
        g = torch.matmul(zw, attn.out_proj.weight.t().reshape(self.H, self.dh, self.D)).reshape(S, self.H * m, self.D)
        rows = p.transpose(1, 2).reshape(S, self.n, self.H * m)
        return torch.baddbmm(attn.out_proj.bias, rows, g)

    # ------------------------------------------------------------------ a live switch of landmarks
    def switched_from(self, state: list[Tensor], t: Tensor) -> list[Tensor]:
        """The state of streams that ran with the other landmark mode, for this step's mode, after
        t (S,) tokens: rows, key scores and p over the window for the new landmarks (continual:
        the segment sums and landmark slots rebuilt from the window first). Streams at t = 0 start
        afresh anyway."""
        s, p, x_ring = self.named(state)
        if self.mode == "continual":
            s = self.nystrom.resumed(s, t)
            marks = (s.q_scaled, s.k_scaled_t, s.z64)
        else:
            marks = self.nystrom.fixed_marks
        s, p = self.nystrom.rows_from_scratch(t, s, p, marks)
        return [*s, *([p] if p is not None else []), *([x_ring] if x_ring is not None else [])]


def stream_landmarks(step: ModelStep, state: list[Tensor], seen: int) -> list[tuple[Tensor, Tensor]]:
    """Per block, the landmarks that streams at the same position, ``seen`` tokens in, used in
    their last step, folded (S * H, m', d_head): block 0's from the state (the slots oldest
    first, or the segment means of a window still filling), block 1's from the window step's
    last call; fixed landmarks as they are (for the batch forward of their windows)."""
    cfg, S = step.cfg, state[0].shape[0]
    m = min(cfg.num_landmarks, seen) if step.mode == "continual" else cfg.num_landmarks

    def fold(ql: Tensor, kl: Tensor) -> tuple[Tensor, Tensor]:
        return tuple(x[:, :, :m].reshape(S * cfg.heads, m, -1) for x in (ql, kl))

    def fixed(block: int) -> tuple[Tensor, Tensor]:
        attn = step.blocks[block].attn
        return fold(attn.fixed_q_land.expand(S, -1, -1, -1), attn.fixed_k_land.expand(S, -1, -1, -1))

    if step.mode == "fixed":
        out = [fixed(0)]
    else:
        s = NystromState(*state[:len(NystromState._fields)])
        if seen >= cfg.window:                           # the slots, oldest landmark first
            out = [fold(*stream_order(s.q_land, s.k_land, int(s.completed[0]), cfg.num_landmarks))]
        else:
            count = torch.full((S,), seen, dtype=torch.int64, device=s.q_ring.device)
            out = [fold(step.nystrom.segments.means(s.q_ring, count)[0], step.nystrom.segments.means(s.k_ring, count)[0])]
    if step.two:
        out.append(fixed(1) if step.mode == "fixed" else fold(*step.window.last))
    return out
