"""The compiled CPU backend of the model step (models/stream/model.py): the steady steps of all S
streams of a model in one compiled call, on the very state arrays the torch step keeps (numpy
views of the same memory), so that the two can take turns stream by stream.

Steady: a 1-block continual model's every step; a continual Nyström model's steps that change
no landmark (fixed landmarks: every step after the first; continual landmarks: past warm-up,
no segment completing, ``landmark_event`` 1); a 2-block model's steps once its window is full
(and no landmark of block 1 changes). The others (warm-up, a landmark replaced, a stream's
first step) take the torch step. A 2-block step's products over the window's n rows are
torch's matrix products between the compiled pieces (blocks.py), for all streams at once.

Shapes: S streams stepped, C rows of state (a batch's slots, models/stream/batch.py), I the
token width. The kernels are called through their compiled entry points (numba_cache.Calls):
every argument is typed once, when a backend first calls a kernel.
"""
from __future__ import annotations


import numpy as np
import torch
from torch import Tensor

from ..landmarks import aligned_segments
from ..stream.nystrom import Landmarks
from ..stream.segments import landmark_event
from ..stream.sums import TAU
from . import blocks as B
from . import kernels as K
from .numba_cache import Calls
from .pinv import pinv64


def model_parameters(stepper) -> list[Tensor]:
    """The parameters of ``stepper``'s model (a ModelStep: its embedding, position table,
    blocks and classifier are the model's own) in the order of kernels.EMBED_W ... HEAD_B, then
    each block's IN_W ... N2_B."""
    params = [stepper.embed.weight, stepper.embed.bias, stepper.table, stepper.head.weight, stepper.head.bias]
    for blk in stepper.blocks:
        a = blk.attn
        params += [a.in_proj.weight, a.in_proj.bias, a.out_proj.weight, a.out_proj.bias, blk.norm1.weight,
                   blk.norm1.bias, blk.ff[0].weight, blk.ff[0].bias, blk.ff[2].weight, blk.ff[2].bias,
                   blk.norm2.weight, blk.norm2.bias]
    return params


def layer_norm_eps(stepper) -> float:
    """The epsilon every LayerNorm of the model shares (kernels.Config.eps)."""
    eps = {float(norm.eps) for blk in stepper.blocks for norm in (blk.norm1, blk.norm2)}
    if len(eps) != 1:
        raise ValueError(f"the compiled step takes one LayerNorm epsilon; this model has {sorted(eps)}")
    return eps.pop()


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


def backend(stepper, state: list[Tensor]) -> "Backend | TwoBlockBackend | None":
    """The backend of ``stepper``'s model over ``state`` (its streams' rows) where
    ``takes_model`` holds, else None; either way the stepper's eager steps (warm-up, landmark
    changes) take the compiled pseudo-inverse on the CPU in float32 (the same arithmetic,
    pinv.pinv64)."""
    p = stepper.embed.weight
    if p.device.type == "cpu" and p.dtype == torch.float32 and stepper.events == "eager":
        stepper.use_inverse(pinv64)
    if not takes_model(stepper):
        return None
    return (TwoBlockBackend if stepper.cfg.layers == 2 else Backend)(stepper, state)


class Backend:
    """The compiled steps of one model's ``stepper`` (ModelStep), 1 block, over ``state`` (the
    torch step's tensors, rows of streams, which it updates in place): ``steady(t)`` which
    positions it takes, ``step(tokens, rows, t)`` those streams' logits and events."""

    def __init__(self, stepper, state: list[Tensor]):
        if not takes_model(stepper):
            raise ValueError("the backend takes continual / continual_nystrom models, float32 on the CPU, "
                             "with the default stability measures")
        cfg = stepper.cfg
        self.stepper, self.cfg, self.n, self.m = stepper, cfg, cfg.window, cfg.num_landmarks
        self.exact, self.mode, self.classes = cfg.variant == "continual", stepper.mode, cfg.num_classes
        self.packed = K.Packed(*pack_parameters(model_parameters(stepper)))
        stab = stepper.stability
        self.config = K.Config(cfg.period, layer_norm_eps(stepper), stab.rescale, stab.refresh, TAU,
                               self.mode == "continual", cfg.pinv_iters)
        self.fixed = None
        if self.mode == "fixed":
            self.fixed = Landmarks(*(x.detach().numpy() for x in stepper.nystrom.fixed_marks))
        self.cycle = None if self.exact or self.mode == "fixed" else landmark_event(np.arange(self.n, 2 * self.n),
                                                                                    self.n, self.m)
        self.bound = self.bind(state)
        self.call = Calls()              # the kernels, typed once (every call passes the same types)
        self._events: dict[int, tuple] = {}

    def steady_at(self, t: int) -> bool:
        """``steady`` for one position (a Python int: the model's own streams, all at t)."""
        if self.exact:
            return True
        if self.cycle is None:
            return t >= 1
        return t >= self.n and self.cycle[t % self.n] == 1

    def all_steady(self, t: np.ndarray) -> bool:
        """Whether the backend takes the step of every position of t (S,)."""
        return self.steady_at(int(t[0])) if len(t) == 1 else bool(self.steady(t).all())

    def steady(self, t: np.ndarray) -> np.ndarray:
        """(S,) bool: the positions whose step the backend takes."""
        if self.exact:
            return np.ones(np.shape(t), bool)
        if self.mode == "fixed":
            return np.asarray(t) >= 1
        return landmark_event(t, self.n, self.m) == 1

    def bind(self, state: list[Tensor]) -> tuple:
        """The state as the kernels take it: block 0's named state of numpy views, its landmarks
        (``Landmarks``: fixed, or the state's own), p and x_ring (2 blocks, else None).
        The kernels write in place, so a tensor that shares memory with another (the torch step
        may hand one tensor on as two, as a fresh row's den and peak) or is not contiguous is
        replaced in ``state`` by a copy first."""
        seen = set()
        for i, x in enumerate(state):
            if not x.is_contiguous() or x.untyped_storage().data_ptr() in seen:
                state[i] = x = x.clone(memory_format=torch.contiguous_format)
            seen.add(x.untyped_storage().data_ptr())
        named, p, x_ring = self.stepper.named(state)
        s, marks = K.arrays(named, self.fixed)
        return s, marks, p.numpy() if p is not None else None, x_ring.numpy() if x_ring is not None else None

    def events(self, S: int) -> tuple[np.ndarray, Tensor]:
        """The events buffer for S streams, (S, 4) int64 zeros where the kernels write none, as
        numpy and torch (the same memory): a step's events hold until the next step."""
        held = self._events.get(S)
        if held is None:
            events = np.zeros((S, 4), np.int64)
            held = self._events[S] = (events, torch.from_numpy(events))
        return held

    def step(self, x: np.ndarray, rows: np.ndarray, t: np.ndarray) -> tuple[Tensor, Tensor]:
        """The steady steps of the streams at ``rows`` of the state (all ``steady``), positions ``t``
        ((S,) int64, C-contiguous): tokens x (S, I) float32, C-contiguous -> logits (S, classes),
        events (S, 4) (``events``)."""
        logits = np.empty((x.shape[0], self.classes), np.float32)
        events, held = self.events(x.shape[0])
        s, marks, _, _ = self.bound
        if self.exact:
            self.call(K.single_output_steps, x, rows, t, self.packed, self.config, s, logits)
        else:
            self.call(K.nystrom_steps, x, rows, t, self.packed, self.config, s, marks, logits, events)
        return torch.from_numpy(logits), held


class TwoBlockBackend(Backend):
    """The compiled steps of a 2-block model: block 0 (retroactive) and block 1's per-row work
    compiled (blocks.py), the products over the window's n rows torch's, all streams at once."""

    def __init__(self, stepper, state: list[Tensor]):
        super().__init__(stepper, state)
        cfg = self.cfg
        b1, b2 = stepper.blocks
        P = lambda t: t.detach().numpy()  # noqa: E731
        D, F, H = cfg.d_model, cfg.ff_dim, cfg.heads
        self.D, self.F, self.H, self.dh = D, F, H, D // H
        self.R = 1 if self.exact else self.m             # block 1's query rows per head
        # block 0's n-row products run in torch on transposed weight views (of the packed buffer);
        # each norm's arguments: (bias of the product before it, norm weight, norm bias, eps)
        Wt = lambda lin: lin.weight.detach().t()  # noqa: E731
        self.out1, self.ff1, self.ff2 = Wt(b1.attn.out_proj), Wt(b1.ff[0]), Wt(b1.ff[2])
        eps = self.config.eps
        self.norm1 = (P(b1.attn.out_proj.bias), P(b1.norm1.weight), P(b1.norm1.bias), eps)
        self.norm2 = (P(b1.ff[2].bias), P(b1.norm2.weight), P(b1.norm2.bias), eps)
        self.b_ff1 = P(b1.ff[0].bias)
        self.fixed2 = None
        if self.mode == "fixed":
            w = stepper.window
            self.fixed2 = Landmarks(P(w.q_scaled), P(w.k_scaled_t), P(w.z))                 # (1, H, ...)
        self._segments: dict[int, np.ndarray] = {}
        self._buffers: dict[int, tuple] = {}

    def steady_at(self, t: int) -> bool:
        return t >= self.n and (self.cycle is None or self.cycle[t % self.n] == 1)

    def steady(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t)
        ok = t >= self.n
        return ok if self.cycle is None else ok & (landmark_event(t, self.n, self.m) == 1)

    def buffers(self, S: int) -> tuple[dict, dict, Landmarks]:
        """Step buffers for S streams: torch tensors (the products), their numpy views (the same
        memory), and block 1's landmarks (``Landmarks``: fixed, or per stream: continual
        landmarks, or the exact query rows)."""
        if S not in self._buffers:
            n, D, F, H, R, dh = self.n, self.D, self.F, self.H, self.R, self.dh
            f32 = lambda *shape: torch.empty(shape)  # noqa: E731
            T = dict(attn=f32(S, n, D), a=f32(S, n, D), y=f32(S, n, D), hid=f32(S, n, F), f=f32(S, n, D),
                     z=f32(S, n, D), u=f32(S, H * R, D), s=f32(S, H * R, n), p=f32(S, H * R, n),
                     px=f32(S, H * R, D), p_all=f32(S, n, H * R), g=f32(S, H * R, D), q2=f32(S, D))
            marks = self.fixed2
            if marks is None:
                marks = Landmarks(*(np.empty(shape, np.float32) for shape in ((S, H, R, dh), (S, H, dh, R), (S, H, R, R))))
            self._buffers[S] = (T, {k: v.numpy() for k, v in T.items()}, marks)
        return self._buffers[S]

    def segments(self, seen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Block 1's aligned segments after ``seen`` (S,) tokens (>= n) as (S, m, 2) window
        ranges (they repeat with period n), and each window's oldest ring slot."""
        out = []
        for tokens in seen.tolist():
            key = tokens % self.n
            if key not in self._segments:
                self._segments[key] = np.array(aligned_segments(self.n + key, self.n, self.m), np.int64)
            out.append(self._segments[key])
        return np.stack(out), seen % self.n

    def step(self, x: np.ndarray, rows: np.ndarray, t: np.ndarray) -> tuple[Tensor, Tensor]:
        S, n, D = x.shape[0], self.n, self.D
        T, A, marks = self.buffers(S)
        events, held = self.events(S)
        s, marks0, cached, x_ring = self.bound
        p, cfg = self.packed, self.config
        if self.exact:
            self.call(B.continual_fronts, x, rows, t, p, cfg, s, x_ring, A["attn"], events)
            torch.mm(T["attn"].view(S * n, D), self.out1, out=T["a"].view(S * n, D))
        else:
            self.call(B.nystrom_fronts, x, rows, t, p, cfg, s, marks0, cached, x_ring, A["p_all"], A["g"], events)
            torch.bmm(T["p_all"], T["g"], out=T["a"])
        # block 0's tail over the n rows: y = LN1(x + attn W_o^T + b_o), z = LN2(y + FF(y))
        x_rows = x_ring[rows].reshape(S * n, D)
        B.norm_rows(x_rows, A["a"].reshape(S * n, D), *self.norm1, A["y"].reshape(S * n, D))
        torch.mm(T["y"].view(S * n, D), self.ff1, out=T["hid"].view(S * n, self.F))
        B.bias_relu(A["hid"].reshape(S * n, self.F), self.b_ff1)
        torch.mm(T["hid"].view(S * n, self.F), self.ff2, out=T["f"].view(S * n, D))
        B.norm_rows(A["y"].reshape(S * n, D), A["f"].reshape(S * n, D), *self.norm2, A["z"].reshape(S * n, D))
        # block 1: the newest row over the window, keys and values folded in
        slots = t % n
        if not self.exact and self.fixed2 is None:
            seg, first = self.segments(t + 1)
            self.call(B.window_landmarks_all, A["z"], seg, first, p, cfg.iters, marks)
        self.call(B.queries_all, A["z"], slots, p, self.exact, marks, A["q2"], A["u"])
        torch.bmm(T["u"], T["z"].transpose(1, 2), out=T["s"])
        torch.softmax(T["s"], dim=-1, out=T["p"])          # torch's exp is vectorised, numba's not
        torch.bmm(T["p"], T["z"], out=T["px"])
        logits = np.empty((S, self.classes), np.float32)
        self.call(B.finish_all, A["px"], p, cfg, self.exact, A["q2"], marks, A["z"], slots, logits)
        return torch.from_numpy(logits), held
