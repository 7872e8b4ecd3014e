"""The compiled CPU backend of the model step (models/stream/model.py): the steady steps of all S
streams of a model in one compiled call, on the very state arrays the torch step keeps (numpy
views of the same memory), so that the two can take turns stream by stream.

Steady: a 1-block continual model's every step; a continual Nyström model's steps that change
no landmark (fixed landmarks: every step after the first; continual landmarks: past warm-up,
no segment completing, ``landmark_event`` 1); a 2-block model's steps once its window is full
(and no landmark of block 1 changes). The others (warm-up, a landmark replaced, a stream's
first step) take the torch step. A 2-block step's products over the window's n rows are
torch's matrix products between the compiled pieces (blocks.py), for all streams at once.

Shapes: S streams stepped, C rows of state (a batch's slots, or a model's B streams), I the
token width.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..landmarks import aligned_segments
from ..stream.segments import landmark_event
from ..stream.sums import TAU
from . import blocks as B
from .pinv import pinv64
from . import kernels as K


def model_parameters(model) -> list[Tensor]:
    """A 1-block model's parameters in the order of kernels.EMBED_W ... HEAD_B."""
    blk = model.blocks[0]
    a = blk.attn
    return [model.embed.weight, model.embed.bias, model.pos.table, a.in_proj.weight,
            a.in_proj.bias, a.out_proj.weight, a.out_proj.bias, blk.norm1.weight,
            blk.norm1.bias, blk.ff[0].weight, blk.ff[0].bias, blk.ff[2].weight, blk.ff[2].bias,
            blk.norm2.weight, blk.norm2.bias, model.head.weight, model.head.bias]


def pack_parameters(tensors: list[Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Move float32 CPU ``tensors`` into one buffer: each tensor's data is rebound to its slice
    (64-byte aligned), so torch and the compiled step read and write the same memory. Returns
    (buffer (total,) float32, layout (N, 3) int64: offset, rows, cols; a vector has rows 1).
    Tensors already packed in this order keep their buffer. (One argument to unbox instead of
    seventeen.)"""
    shapes = [(t.shape[0], t.shape[1]) if t.dim() == 2 else (1, t.numel()) for t in tensors]
    offsets, total = [], 0
    for rows, cols in shapes:
        offsets.append(total)
        total += -(-rows * cols // 16) * 16
    layout = np.array([(o, r, c) for o, (r, c) in zip(offsets, shapes)], np.int64)
    base = tensors[0].untyped_storage()
    if base.nbytes() == 4 * total and all(
            t.untyped_storage().data_ptr() == base.data_ptr() and t.storage_offset() == o
            and t.is_contiguous() for t, o in zip(tensors, offsets)):
        return torch.empty(0).set_(base, 0, (total,)).numpy(), layout
    whole = torch.zeros(total)
    for t, (off, rows, cols) in zip(tensors, layout):
        view = whole[off:off + rows * cols].view(t.shape)
        view.copy_(t.detach())
        t.data = view
    return whole.numpy(), layout


def takes_model(stepper) -> bool:
    """Whether the backend steps the model of ``stepper`` (a ModelStep): float32 on the CPU,
    with the default stability measures."""
    p = stepper.embed.weight
    return p.device.type == "cpu" and p.dtype == torch.float32 and stepper.stability.wide


def backend(stepper) -> "Backend | TwoBlockBackend | None":
    """The backend of ``stepper``'s model where ``takes_model`` holds, else None; either way the
    stepper's eager steps (warm-up, landmark changes) take the compiled pseudo-inverse on the
    CPU in float32 (the same arithmetic, pinv.pinv64)."""
    p = stepper.embed.weight
    if p.device.type == "cpu" and p.dtype == torch.float32 and stepper.events == "eager":
        stepper.use_inverse(pinv64)
    if not takes_model(stepper):
        return None
    return TwoBlockBackend(stepper) if stepper.cfg.layers == 2 else Backend(stepper)


class Backend:
    """The compiled steps of one model's ``stepper`` (ModelStep): ``steady(t)`` which positions
    it takes, ``step(tokens, rows, t, state)`` those streams' logits and events."""

    def __init__(self, stepper):
        if not takes_model(stepper) or stepper.cfg.layers != 1:
            raise ValueError("this backend takes 1-block continual / continual_nystrom models, float32 on the CPU")
        cfg = stepper.cfg
        self.stepper, self.cfg, self.n, self.m = stepper, cfg, cfg.window, cfg.num_landmarks
        self.exact = cfg.variant == "continual"
        self.mode = stepper.mode
        block = stepper.blocks[0]
        self.w, self.layout = pack_parameters(model_parameters(_Params(stepper)))
        self.eps = (float(block.norm1.eps), float(block.norm2.eps))
        D, F = cfg.d_model, cfg.ff_dim
        self.scratch = np.zeros(9 * D + F, np.float32)
        self.scores = np.empty(self.n, np.float32)
        self.buf = np.empty((3, max(1, self.m)))
        self.period, self.classes, self.in_dim = cfg.period, cfg.num_classes, cfg.in_dim
        self.stability = stepper.stability
        self.fixed = None
        if self.mode == "fixed":
            self.fixed = tuple(x.detach().numpy() for x in stepper.nystrom.fixed_marks)
        self._views: tuple = ((), ())
        self.cycle = None if self.exact or self.mode == "fixed" else landmark_event(np.arange(self.n, 2 * self.n),
                                                                                    self.n, self.m)

    def steady_at(self, t: int) -> bool:
        """``steady`` for one position (a Python int: the model's own streams, all at t)."""
        if self.exact:
            return True
        if self.cycle is None:
            return t >= 1
        return t >= self.n and self.cycle[t % self.n] == 1

    def steady(self, t: np.ndarray) -> np.ndarray:
        """(S,) bool: the positions whose step the backend takes."""
        if self.exact:
            return np.ones(np.shape(t), bool)
        if self.mode == "fixed":
            return np.asarray(t) >= 1
        return landmark_event(t, self.n, self.m) == 1

    def views(self, state: list[Tensor]) -> tuple:
        """numpy views of the state tensors, made again only when the tensors change. The
        kernels write in place, so a tensor that shares memory with another (the torch step may
        hand one tensor on as two, as a fresh row's den and peak) or is not contiguous is
        replaced in ``state`` by a copy of its own first."""
        held, arrays = self._views
        if len(held) != len(state) or any(a is not b for a, b in zip(held, state)):
            seen = set()
            for i, x in enumerate(state):
                if not x.is_contiguous() or x.untyped_storage().data_ptr() in seen:
                    state[i] = x = x.clone(memory_format=torch.contiguous_format)
                seen.add(x.untyped_storage().data_ptr())
            arrays = tuple(x.numpy() for x in state)
            self._views = (tuple(state), arrays)
        return arrays

    def step(self, tokens: Tensor, rows: np.ndarray, t: np.ndarray, state: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The steady steps of streams at ``rows`` of ``state`` (all ``steady``), positions ``t``:
        tokens (S, I) float32, contiguous -> logits (S, classes), events (S, 4)."""
        x = tokens.numpy()
        S = x.shape[0]
        logits = np.empty((S, self.classes), np.float32)
        events = np.zeros((S, 4), np.int64)
        a = self.views(state)
        eps1, eps2 = self.eps
        if self.exact:
            K.model_steps_continual(x, rows, t, self.w, self.layout, eps1, eps2, self.scratch, a[0], a[1],
                                    self.period, self.scores, logits)
        else:
            marks = self.fixed if self.fixed is not None else (a[14], a[15], a[16])
            stab = self.stability
            K.model_steps_nystrom(x, rows, t, self.w, self.layout, eps1, eps2, self.scratch, a[0], a[1], a[2], a[3],
                                  a[4], a[5], a[6], a[7], *marks, self.fixed is not None, a[8], a[9], a[10],
                                  self.period, self.mode == "continual", stab.rescale, stab.refresh, TAU, self.buf,
                                  logits, events)
        return torch.from_numpy(logits), torch.from_numpy(events)


class _Params:
    """The modules ``model_parameters`` reads, from a ModelStep (its embedding, position table,
    block and head are the model's own)."""

    def __init__(self, stepper):
        self.embed, self.blocks, self.head = stepper.embed, stepper.blocks, stepper.head
        self.pos = type("Pos", (), {"table": stepper.table})()


class TwoBlockBackend(Backend):
    """The compiled steps of a 2-block model: block 1 (retroactive) and block 2's per-row work
    compiled (blocks.py), the products over the window's n rows torch's, all streams at once."""

    def __init__(self, stepper):
        cfg = stepper.cfg
        if not takes_model(stepper) or cfg.layers != 2:
            raise ValueError("this backend takes 2-block continual / continual_nystrom models, float32 on the CPU")
        self.stepper, self.cfg, self.n, self.m = stepper, cfg, cfg.window, cfg.num_landmarks
        self.exact, self.mode, self.stability = cfg.variant == "continual", stepper.mode, stepper.stability
        b1, b2 = stepper.blocks
        P = lambda t: t.detach().numpy()  # noqa: E731
        self.pre = (P(stepper.embed.weight), P(stepper.embed.bias), P(stepper.table),
                    P(b1.attn.in_proj.weight), P(b1.attn.in_proj.bias))
        self.post2 = (P(b2.attn.out_proj.weight), P(b2.attn.out_proj.bias), P(b2.norm1.weight), P(b2.norm1.bias),
                      P(b2.ff[0].weight), P(b2.ff[0].bias), P(b2.ff[2].weight), P(b2.ff[2].bias),
                      P(b2.norm2.weight), P(b2.norm2.bias), P(stepper.head.weight), P(stepper.head.bias))
        self.eps2 = (float(b2.norm1.eps), float(b2.norm2.eps))
        D, F, H, n = cfg.d_model, cfg.ff_dim, cfg.heads, cfg.window
        self.D, self.F, self.H, self.dh = D, F, H, D // H
        self.R = 1 if self.exact else self.m             # block 2's query rows per head
        w, bias = P(b2.attn.in_proj.weight), P(b2.attn.in_proj.bias)
        self.w_q, self.b_q, self.w_k = w[:D], bias[:D], w[D:2 * D]
        self.w_v, self.b_v = w[2 * D:], bias[2 * D:]
        self.w_qk, self.b_qk = w[:2 * D], bias[:2 * D]
        # block 1's n-row products run in torch on transposed weight views; each norm's arguments:
        # (bias of the product before it, norm weight, norm bias, eps)
        Wt = lambda lin: lin.weight.detach().t()  # noqa: E731
        self.out1, self.ff1, self.ff2 = Wt(b1.attn.out_proj), Wt(b1.ff[0]), Wt(b1.ff[2])
        self.norm1 = (P(b1.attn.out_proj.bias), P(b1.norm1.weight), P(b1.norm1.bias), float(b1.norm1.eps))
        self.norm2 = (P(b1.ff[2].bias), P(b1.norm2.weight), P(b1.norm2.bias), float(b1.norm2.eps))
        self.b_ff1, self.w_o1 = P(b1.ff[0].bias), P(b1.attn.out_proj.weight)
        f32 = lambda *shape: np.empty(shape, np.float32)  # noqa: E731
        self.h, self.qkv, self.zw = f32(D), f32(3 * D), f32(H, self.m or 1, self.dh)
        self.mixed, self.attn2 = f32(H, self.R, self.dh), f32(D)
        self.means, self.qk = f32(self.R, D), f32(self.R, 2 * D)
        self.bufs = (f32(D), f32(D), f32(F), f32(D), f32(D))
        self.period, self.classes, self.iters = cfg.period, cfg.num_classes, cfg.pinv_iters
        self.fixed = self.fixed2 = None
        if self.mode == "fixed":
            self.fixed = tuple(x.detach().numpy() for x in stepper.nystrom.fixed_marks)
            w2 = stepper.window
            self.fixed2 = (P(w2.q_scaled), P(w2.k_scaled_t), P(w2.z))                 # (1, H, ...)
        self.cycle = None if self.exact or self.mode == "fixed" else landmark_event(np.arange(n, 2 * n), n, self.m)
        self._segments: dict[int, np.ndarray] = {}
        self._views: tuple = ((), ())
        self._buffers: dict[int, dict] = {}

    def steady_at(self, t: int) -> bool:
        return t >= self.n and (self.cycle is None or self.cycle[t % self.n] == 1)

    def steady(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t)
        ok = t >= self.n
        return ok if self.cycle is None else ok & (landmark_event(t, self.n, self.m) == 1)

    def buffers(self, S: int) -> dict:
        """Step buffers for S streams, torch tensors (the products) with numpy views (the same memory)."""
        if S not in self._buffers:
            n, D, F, H, R, m1 = self.n, self.D, self.F, self.H, self.R, 1 if self.exact else self.m
            f32 = lambda *shape: torch.empty(shape)  # noqa: E731
            T = dict(attn=f32(S, n, D), a=f32(S, n, D), y=f32(S, n, D), hid=f32(S, n, F), f=f32(S, n, D),
                     z=f32(S, n, D), u=f32(S, H * R, D), s=f32(S, H * R, n), p=f32(S, H * R, n),
                     px=f32(S, H * R, D), p_all=f32(S, n, H * m1), g=f32(S, H * m1, D), q2=f32(S, D),
                     rows=f32(S, H, R, self.dh))
            if not self.exact and self.mode != "fixed":          # block 2's continual landmarks, per stream
                T.update(q_land=f32(S, H, R, self.dh), k_land=f32(S, H, R, self.dh), k_scaled_t=f32(S, H, self.dh, R),
                         z32=f32(S, H, R, R), z64=torch.empty(S, H, R, R, dtype=torch.float64))
            self._buffers[S] = {k: (v, v.numpy()) for k, v in T.items()}
        return self._buffers[S]

    def segments(self, seen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Block 2's aligned segments after ``seen`` (S,) tokens (>= n) as (S, m, 2) window
        ranges (they repeat with period n), and each window's oldest ring slot."""
        out = []
        for tokens in seen.tolist():
            key = tokens % self.n
            if key not in self._segments:
                self._segments[key] = np.array(aligned_segments(self.n + key, self.n, self.m), np.int64)
            out.append(self._segments[key])
        return np.stack(out), seen % self.n

    def step(self, tokens: Tensor, rows: np.ndarray, t: np.ndarray, state: list[Tensor]) -> tuple[Tensor, Tensor]:
        x = tokens.numpy()
        S, n, D = x.shape[0], self.n, self.D
        T = self.buffers(S)
        A = {k: v[1] for k, v in T.items()}
        T = {k: v[0] for k, v in T.items()}
        events = np.zeros((S, 4), np.int64)
        a = self.views(state)
        stab = self.stability
        x_ring = a[-1]
        if self.exact:
            B.continual_fronts(x, rows, t, self.pre, self.period, self.h, self.qkv, a[0], a[1], a[2], a[3], a[4],
                               a[5], a[6], a[7], x_ring, stab.rescale, stab.refresh, TAU, A["attn"], events)
            torch.mm(T["attn"].view(S * n, D), self.out1, out=T["a"].view(S * n, D))
        else:
            marks = self.fixed if self.fixed is not None else (a[14], a[15], a[16])
            B.nystrom_fronts(x, rows, t, self.pre, self.period, self.h, self.qkv, a[0], a[1], a[2], a[3], a[4], a[5],
                             a[6], a[7], *marks, self.fixed is not None, a[8], a[9], a[10], x_ring, a[17],
                             self.mode == "continual", stab.rescale, stab.refresh, TAU, self.zw, self.w_o1,
                             A["p_all"], A["g"], events)
            torch.bmm(T["p_all"], T["g"], out=T["a"])
        # block 1's tail over the n rows: y = LN1(x + attn W_o^T + b_o), z = LN2(y + FF(y))
        x_rows = x_ring[rows].reshape(S * n, D)
        B.norm_rows(x_rows, A["a"].reshape(S * n, D), *self.norm1, A["y"].reshape(S * n, D))
        torch.mm(T["y"].view(S * n, D), self.ff1, out=T["hid"].view(S * n, self.F))
        B.bias_relu(A["hid"].reshape(S * n, self.F), self.b_ff1)
        torch.mm(T["hid"].view(S * n, self.F), self.ff2, out=T["f"].view(S * n, D))
        B.norm_rows(A["y"].reshape(S * n, D), A["f"].reshape(S * n, D), *self.norm2, A["z"].reshape(S * n, D))
        # block 2: the newest row over the window, keys and values folded in
        slots = t % n
        shared = True
        if self.exact:
            q_rows, k_scaled_t, zl = A["rows"], A["rows"], A["rows"]      # (exact: the landmark arguments unused)
            shared = False
        elif self.fixed2 is not None:
            q_rows, k_scaled_t, zl = self.fixed2
        else:
            seg, first = self.segments(t + 1)
            B.window_landmarks_all(A["z"], seg, first, self.w_qk, self.b_qk, self.iters, self.means, self.qk,
                                   A["q_land"], A["k_land"], A["rows"], A["k_scaled_t"], A["z64"], A["z32"])
            q_rows, k_scaled_t, zl, shared = A["rows"], A["k_scaled_t"], A["z32"], False
        B.queries_all(A["z"], slots, self.w_q, self.b_q, self.w_k, self.exact, q_rows, shared, A["q2"], A["u"])
        torch.bmm(T["u"], T["z"].transpose(1, 2), out=T["s"])
        torch.softmax(T["s"], dim=-1, out=T["p"])          # torch's exp is vectorised, numba's not
        torch.bmm(T["p"], T["z"], out=T["px"])
        logits = np.empty((S, self.classes), np.float32)
        B.finish_all(A["px"], self.w_v, self.b_v, self.mixed, self.exact, A["q2"], k_scaled_t, zl, shared,
                     self.attn2, A["z"], slots, self.post2, *self.eps2, self.bufs, logits)
        return torch.from_numpy(logits), torch.from_numpy(events)
