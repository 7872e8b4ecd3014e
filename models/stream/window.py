"""The second block of a 2-block model: the newest token's attention over the window that the
retroactive first block gives anew every step (ring order, slot t % n holds token t).

The window's keys and values are never formed: the products go through the window x with the
projections folded in, q_h . k_j = (W_k,h^T q_h) . x_j + q_h . b_k,h (the last term is a constant
per row, which a softmax ignores) and sum_j p_j v_j = (sum_j p_j x_j) W_v,h^T + b_v,h (rows of p
sum to 1), r x n x D per product instead of the n x D x 2D projection.

Attention: 'continual' (exact, the newest query over the window), Nyström with 'fixed'
landmarks, or with 'continual' landmarks: the stream-aligned segment means of this window
(models/stream/nystrom.py ``Segments``), projected, new every step because the whole window is.

Shapes: S streams, H heads, dh the head width, D = H dh, n the window, m landmarks; xw (S, n, D),
x_new (S, D), t (S,).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as nnf

from ..sda.reference import pinv
from .nystrom import Landmarks, Segments, install, masked
from .ops import filled

F32 = torch.float32


class WindowStep(nn.Module):
    """Block 1's attention for the newest token: ``forward(t, xw, x_new)`` -> (S, H, dh).
    ``attention``: 'continual', 'fixed' (with ``fixed``) or 'landmarks' (continual landmarks).
    The landmarks of the last eager call are kept in ``last`` (S, H, m, dh) x 2, for display."""

    def __init__(self, attn, n: int, attention: str, *, m: int = 0, iters: int = 6, fixed: Landmarks | None = None):
        super().__init__()
        self.attn, self.attention, self.iters = attn, attention, iters
        self.inverse = pinv                  # the landmarks' pseudo-inverse (ModelStep.use_inverse)
        self.H, self.D = attn.heads, attn.d_model
        self.dh = self.D // self.H
        self.scale = self.dh ** -0.5
        self.register_buffer("slots", torch.arange(n))
        if attention == "fixed":
            self.register_buffer("q_scaled", fixed.q_scaled)
            self.register_buffer("k_scaled_t", fixed.k_scaled_t)
            self.register_buffer("z", fixed.z.to(F32))
        if attention == "landmarks":
            self.segments = Segments(n, m)
        self.last: tuple[Tensor, Tensor] | None = None

    def weights(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """w_q, b_q, w_k, w_v, b_v of the packed in-projection."""
        w, b, D = self.attn.in_proj.weight, self.attn.in_proj.bias, self.D
        return w[:D], b[:D], w[D:2 * D], w[2 * D:], b[2 * D:]

    def scores(self, qs: Tensor, xw: Tensor, valid: Tensor) -> Tensor:
        """Scaled query rows qs (S, H, r, dh) against the window's keys, folded: (S, H, r, n),
        -inf at slots not filled."""
        w_k = self.weights()[2].view(self.H, self.dh, self.D)
        u = torch.matmul(qs, w_k)                                               # (S, H, r, D)
        s = torch.matmul(u, xw.transpose(1, 2).unsqueeze(1))
        return s.masked_fill(~valid.view(valid.shape[0], 1, 1, -1), float("-inf"))

    def mix(self, p: Tensor, xw: Tensor) -> Tensor:
        """Rows p (S, H, r, n) summing to 1 over the window -> p V (S, H, r, dh), folded."""
        w_v, b_v = self.weights()[3:]
        px = torch.matmul(p, xw.unsqueeze(1))                                   # (S, H, r, D)
        return torch.matmul(px, w_v.view(self.H, self.dh, self.D).transpose(1, 2)) + b_v.view(self.H, 1, self.dh)

    def forward(self, t: Tensor, xw: Tensor, x_new: Tensor) -> Tensor:
        S, H, dh = xw.shape[0], self.H, self.dh
        w_q, b_q = self.weights()[:2]
        q = nnf.linear(x_new, w_q, b_q).view(S, H, dh)
        valid = filled(t, self.slots)
        if self.attention == "continual":
            p = torch.softmax(self.scores((q * self.scale).unsqueeze(2), xw, valid), dim=-1)
            return self.mix(p, xw).squeeze(2)
        present = None
        if self.attention == "fixed":
            q_scaled, k_scaled_t, z = self.q_scaled.to(q.dtype), self.k_scaled_t.to(q.dtype), self.z.to(q.dtype)
        else:
            means, present = self.segments.means(xw, t + 1)                     # (S, m, D), (S, m)
            D, m = self.D, means.shape[1]
            qk = nnf.linear(means, self.attn.in_proj.weight[:2 * D], self.attn.in_proj.bias[:2 * D])
            ql = qk[..., :D].reshape(S, m, H, dh).transpose(1, 2)               # (S, H, m, dh)
            kl = qk[..., D:].reshape(S, m, H, dh).transpose(1, 2)
            q_scaled, k_scaled_t, z64 = install(ql, kl, self.iters, present, self.inverse)
            z = z64.to(q.dtype)
            if not torch.compiler.is_compiling() and not torch.jit.is_tracing():
                self.last = (ql, kl)
        k1 = torch.softmax(masked(torch.matmul(q.unsqueeze(2), k_scaled_t), present), dim=-1)   # (S, H, 1, m)
        k3 = torch.softmax(self.scores(q_scaled, xw, valid), dim=-1)                            # (S, H, m, n)
        return torch.matmul(torch.matmul(k1, z), self.mix(k3, xw)).squeeze(2)
