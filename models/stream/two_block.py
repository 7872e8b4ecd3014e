"""The explicit-state step of a 2-block model, for ONNX export: block 0 retroactive (every
query of the window updated each step, models/stream/graph.py and graph_landmarks.py with
``retroactive``), block 1 single-output over the window block 0 gives (GenreTransformer.step).

Block 0's window lives in ring order: slot t % n holds the t-th token. Block 1's attention needs
no order of its keys (a softmax over them, sums weighted by it); its continual landmarks do: the
stream-aligned segments of models/landmarks.aligned_segments, mapped to ring slots at export
(graph.SegmentMeans). Block 1's keys
and values are never formed: its products go through the window with the projections folded in,
as models/sda/window.FoldedKeyValues does. Its only state is block 0's: the window of inputs for
the residuals (``x_ring``) is the one piece this module adds.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as nnf

from ..sda.reference import landmark_pinv
from .graph import (EXPORTABLE, ContinualGraph, FixedNystromGraph, NotExportable,
                           RetroactiveGraph, SegmentMeans, StateTensor, StreamGraph, masked,
                           present_pinv)
from .graph_landmarks import ContinualNystromGraph

KINDS = ("continual", "continual_nystrom/continual", "continual_nystrom/fixed")


def stream_graph(model, masked: bool = False) -> "StreamGraph | TwoBlockGraph":
    """The explicit-state step of ``model`` (a GenreTransformer in eval mode): for ONNX export,
    or, ``masked`` (its events as selects, graph.branch), for a batch of streams."""
    cfg = model.cfg
    if cfg.variant not in EXPORTABLE:
        raise NotExportable(f"a {cfg.variant!r} model recomputes its window each step and has no "
                            f"streaming state to export; exportable: "
                            f"continual, continual_nystrom (continual or fixed landmarks)")
    fixed = cfg.variant == "continual_nystrom" and model.landmark_mode == "fixed"
    if cfg.variant == "continual":
        first = RetroactiveGraph if cfg.layers == 2 else ContinualGraph
    else:
        first = FixedNystromGraph if fixed else ContinualNystromGraph
    graph = first(model)
    graph.masked = masked
    if cfg.layers == 1:
        return graph
    second = ContinualWindow if cfg.variant == "continual" else FixedWindow if fixed else LandmarkWindow
    return TwoBlockGraph(model, graph, second(model))


def state_spec_for(cfg, kind: str) -> list[StateTensor]:
    """The state inputs of an export of a ``cfg`` model of ``kind`` (one of KINDS), without
    building it: what a loader checks an exported file's inputs against."""
    two = cfg.layers == 2
    first = {"continual": RetroactiveGraph if two else ContinualGraph,
             "continual_nystrom/continual": ContinualNystromGraph,
             "continual_nystrom/fixed": FixedNystromGraph}[kind]
    spec = first.spec(cfg.heads, cfg.window, cfg.d_model // cfg.heads, cfg.num_landmarks, two)
    return spec + ([StateTensor("x_ring", (cfg.window, cfg.d_model), torch.float32)] if two else [])


class TwoBlockGraph(nn.Module):
    """forward(token, t, *state) -> (logits, t + 1, events, *next_state), as a 1-block graph;
    the events are block 0's (block 1 recomputes its window every step)."""

    def __init__(self, model, first: StreamGraph, second: "WindowAttention"):
        super().__init__()
        self.first, self.second, self.kind = first, second, first.kind
        self.block1, self.head = model.blocks[1], model.head
        self.n, self.d = first.n, model.cfg.d_model

    def state_spec(self) -> list[StateTensor]:
        return self.first.state_spec() + [StateTensor("x_ring", (self.n, self.d), torch.float32)]

    def initial_state(self) -> list[Tensor]:
        return [torch.zeros(s.shape, dtype=s.dtype) for s in self.state_spec()]

    def forward(self, token: Tensor, t: Tensor, *state: Tensor):
        first, n, d = self.first, self.n, self.d
        *state, x_ring = state
        x_ring = torch.where(t == 0, x_ring.new_zeros(()), x_ring)
        h, q, k, v = first.project(token, t)
        a, events, *state = first.attend(t, q, k, v, *state)                   # (H, n, dh)
        here = first.slot_mask(t)
        x_ring = torch.where(here.view(n, 1), h, x_ring)                       # (n, d)
        attn0 = first.attn
        out = nnf.linear(a.transpose(0, 1).reshape(n, d), attn0.out_proj.weight, attn0.out_proj.bias)
        xw = first.block._tail(x_ring, out)                                    # (n, d) ring order
        newest = torch.argmax(here.to(torch.int64)).view(1)
        x_new = torch.index_select(xw, 0, newest)                              # (1, d)
        a1 = self.second(t, xw, x_new)                                         # (H, dh)
        attn1 = self.block1.attn
        out1 = nnf.linear(a1.reshape(1, d), attn1.out_proj.weight, attn1.out_proj.bias)
        logits = nnf.linear(self.block1._tail(x_new, out1), self.head.weight, self.head.bias)
        return (logits, t + 1, events, *state, x_ring)


class WindowAttention(nn.Module):
    """Block 1's attention for the newest token over block 0's window xw (n, d), ring order."""

    def __init__(self, model):
        super().__init__()
        cfg, self.attn = model.cfg, model.blocks[1].attn
        self.n, self.H, self.d = cfg.window, cfg.heads, cfg.d_model
        self.dh = self.d // self.H
        self.scale = self.dh ** -0.5
        self.register_buffer("slots", torch.arange(self.n))

    def weights(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """w_q, b_q, w_k, w_v, b_v of the packed in-projection."""
        w, b, d = self.attn.in_proj.weight, self.attn.in_proj.bias, self.d
        return w[:d], b[:d], w[d:2 * d], w[2 * d:], b[2 * d:]

    def query(self, x_new: Tensor) -> Tensor:
        """The newest token's query (H, dh)."""
        w_q, b_q = self.weights()[:2]
        return nnf.linear(x_new, w_q, b_q).view(self.H, self.dh)

    def scores(self, qs: Tensor, xw: Tensor, valid: Tensor) -> Tensor:
        """Scaled query rows qs (H, r, dh) against the window's keys, folded: (H, r, n), -inf
        at slots not filled (the key bias adds a constant per row, which a softmax ignores)."""
        w_k = self.weights()[2]
        u = torch.matmul(qs, w_k.view(self.H, self.dh, self.d))                 # (H, r, d)
        s = torch.matmul(u, xw.transpose(0, 1))
        return s.masked_fill(~valid.view(1, 1, -1), float("-inf"))

    def mix(self, p: Tensor, xw: Tensor) -> Tensor:
        """Rows p (H, r, n) summing to 1 over the window -> p V (H, r, dh), folded."""
        w_v, b_v = self.weights()[3:]
        px = torch.matmul(p, xw)                                                # (H, r, d)
        return torch.matmul(px, w_v.view(self.H, self.dh, self.d).transpose(1, 2)) + b_v.view(self.H, 1, self.dh)

    def nystrom(self, q: Tensor, xw: Tensor, valid: Tensor, q_scaled: Tensor, k_scaled_t: Tensor,
                z: Tensor, present: Tensor | None = None) -> Tensor:
        """s(q K~^T) Z s(Q~ K^T) V (H, dh), float32 throughout as the torch window step;
        ``present``: the landmarks in use (models/stream/graph.present_pinv)."""
        k1 = torch.softmax(masked(torch.matmul(q.unsqueeze(1), k_scaled_t), present), dim=-1)   # (H, 1, m)
        k3 = torch.softmax(self.scores(q_scaled, xw, valid), dim=-1)           # (H, m, n)
        return torch.matmul(torch.matmul(k1, z), self.mix(k3, xw)).squeeze(1)


class ContinualWindow(WindowAttention):
    """Single-output SDA of the newest query over the window."""

    def forward(self, t: Tensor, xw: Tensor, x_new: Tensor) -> Tensor:
        qs = self.query(x_new).unsqueeze(1) * self.scale
        p = torch.softmax(self.scores(qs, xw, self.slots < t + 1), dim=-1)
        return self.mix(p, xw).squeeze(1)


class FixedWindow(WindowAttention):
    """Nyström SDA of the newest query with the block's fixed (k-means) landmarks."""

    def __init__(self, model):
        super().__init__(model)
        if not bool(self.attn.has_fixed):
            raise NotExportable("this model's fixed landmarks are not fitted (block 1)")
        ql, kl = self.attn.fixed_q_land.detach(), self.attn.fixed_k_land.detach()
        self.register_buffer("q_scaled", (ql * self.scale).contiguous())
        self.register_buffer("k_scaled_t", (kl * self.scale).transpose(1, 2).contiguous())
        self.register_buffer("z", landmark_pinv(ql, kl, self.attn.pinv_iters).contiguous())

    def forward(self, t: Tensor, xw: Tensor, x_new: Tensor) -> Tensor:
        return self.nystrom(self.query(x_new), xw, self.slots < t + 1, self.q_scaled,
                            self.k_scaled_t, self.z)


class LandmarkWindow(WindowAttention):
    """Nyström SDA of the newest query with continual landmarks: the stream-aligned segment
    means of this window (models/mha.py, step_window), projected, with their pseudo-inverse;
    new every step because block 0 updates the whole window."""

    def __init__(self, model):
        super().__init__(model)
        self.m, self.iters = self.attn.num_landmarks, self.attn.pinv_iters
        self.segment_means = SegmentMeans(self.n, self.m)

    def forward(self, t: Tensor, xw: Tensor, x_new: Tensor) -> Tensor:
        """Fewer than m tokens seen: one landmark each, the others absent (present_pinv)."""
        seen = t + 1
        means, present = self.segment_means(xw, seen)                          # (m, d), (m,)
        H, dh, d = self.H, self.dh, self.d
        qk = nnf.linear(means, self.attn.in_proj.weight[:2 * d], self.attn.in_proj.bias[:2 * d])
        ql = qk[:, :d].reshape(self.m, H, dh).transpose(0, 1)                   # (H, m, dh)
        kl = qk[:, d:].reshape(self.m, H, dh).transpose(0, 1)
        z = present_pinv(ql, kl, present, self.iters)
        return self.nystrom(self.query(x_new), xw, self.slots < seen, ql * self.scale,
                            (kl * self.scale).transpose(1, 2), z, present)
