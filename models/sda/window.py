"""The keys and values a window-fed kernel attends over (the single-output layer after a
retroactive one, whose whole window changes every step).

Both classes answer two questions for rows of scaled queries (B, r, d), heads folded into B:
  scores(qs) -> (B, r, n_t)   qs K^T, up to a constant per row (a softmax over keys ignores it)
  mix(p)     -> (B, r, d)     p V, for rows p (B, r, n_t) that sum to 1

``KeyValues`` holds projected keys and values. ``FoldedKeyValues`` holds the layer's input window
x (S, n_t, D) and its key/value projections and never forms K or V (n_t x D x 2D per step):
  q_h . k_j     = (W_k,h^T q_h) . x_j + q_h . b_k,h      (the last term is the row constant)
  sum_j p_j v_j = (sum_j p_j x_j) W_v,h^T + b_v,h          (sum_j p_j = 1)
so a step costs r x n_t x D per product instead of the projection (models/flops.folded_kv).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KeyValues:
    """Projected keys and values of the window: k, v (B, n_t, d)."""
    k: Tensor
    v: Tensor

    @property
    def n_t(self) -> int:
        return self.k.shape[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, n_t, d) the keys' and values' shape, checked by the kernel."""
        if self.k.shape != self.v.shape:
            raise ValueError(f"k and v must have one shape, got {tuple(self.k.shape)} and "
                             f"{tuple(self.v.shape)}")
        return tuple(self.k.shape)

    def scores(self, qs: Tensor) -> Tensor:
        return torch.bmm(qs, self.k.transpose(1, 2))

    def mix(self, p: Tensor) -> Tensor:
        return torch.bmm(p, self.v)


@dataclass
class FoldedKeyValues:
    """The window x (S, n_t, D) with the key/value projections folded into the products.

    w_k, w_v: (D, D) rows = heads x d, head index slowest (as in nn.MultiheadAttention);
    b_v: (D,). Kernel rows are S x heads, head index fastest (models/mha.py)."""
    x: Tensor
    w_k: Tensor
    w_v: Tensor
    b_v: Tensor
    heads: int

    @property
    def n_t(self) -> int:
        return self.x.shape[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, n_t, d) the shape the projected keys and values would have."""
        S, n_t, D = self.x.shape
        return S * self.heads, n_t, D // self.heads

    def scores(self, qs: Tensor) -> Tensor:
        S, n_t, D = self.x.shape
        H, r, d = self.heads, qs.shape[1], qs.shape[2]
        u = torch.einsum("shrd,hde->shre", qs.view(S, H, r, d), self.w_k.view(H, d, D))
        return torch.bmm(u.reshape(S, H * r, D), self.x.transpose(1, 2)).view(S * H, r, n_t)

    def mix(self, p: Tensor) -> Tensor:
        S, n_t, D = self.x.shape
        H, r = self.heads, p.shape[1]
        d = D // H
        px = torch.bmm(p.reshape(S, H * r, n_t), self.x).view(S, H, r, D)       # sum_j p_j x_j
        out = torch.einsum("shre,hde->shrd", px, self.w_v.view(H, d, D))
        return (out + self.b_v.view(1, H, 1, d)).reshape(S * H, r, d)
