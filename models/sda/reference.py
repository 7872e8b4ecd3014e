"""Batch references of scaled dot-product attention: exact softmax and Nyström.

Shapes: heads are folded into the batch, so every tensor is (B, n, d) with d the head dimension.
These are the oracles the streaming kernels (models/sda/) are tested against.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ..variants import LANDMARK_MODES, VARIANTS      # noqa: F401  (the names, kept here for the references' callers)


def inference(fn):
    """Run ``fn`` without autograd; cheap when grad mode is already off (nested steps)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Exact softmax attention. q: (B, nq, d), k, v: (B, n, d) -> (B, nq, d), scale 1/sqrt(d)."""
    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))  # (B, nq, n)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def pinv(a: Tensor, iters: int = 6) -> Tensor:
    """Iterative Moore-Penrose inverse of a: (B, m, m) (Razavi et al., as in Nyströmformer).

    Z0 = a^T / (max column sum * max row sum), computed per matrix (not over the batch), then
    Z <- 1/4 Z (13 I - A Z (15 I - A Z (7 I - A Z))) ``iters`` times. The iteration runs in
    float64 whatever the input dtype (m x m is tiny, and the inverse amplifies rounding), and the
    result is cast back.
    """
    out_dtype = a.dtype
    a = a.double()
    absa = a.abs()
    norm = absa.sum(dim=-2).amax(dim=-1) * absa.sum(dim=-1).amax(dim=-1)        # (B,)
    z = a.transpose(-1, -2) / norm[..., None, None]
    eye = torch.eye(a.shape[-1], device=a.device, dtype=a.dtype)
    for _ in range(iters):
        az = torch.matmul(a, z)
        z = 0.25 * torch.matmul(z, 13 * eye - torch.matmul(az, 15 * eye - torch.matmul(az, 7 * eye - az)))
    return z.to(out_dtype)


def landmark_pinv(q_land: Tensor, k_land: Tensor, iters: int = 6) -> Tensor:
    """pinv(s(Q~ K~^T / sqrt(d))): (B, m, d) x 2 -> (B, m, m), in the landmarks' dtype.

    The m x m kernel is formed in float64: its rounding is what the pseudo-inverse amplifies, and
    at m x m x d it costs nothing next to the rest of the step.
    """
    s = 1.0 / math.sqrt(q_land.shape[-1])
    kernel = torch.softmax(torch.matmul(q_land.double() * s, k_land.double().transpose(-1, -2)), dim=-1)
    return pinv(kernel, iters).to(q_land.dtype)


def nystrom_attention(q: Tensor, k: Tensor, v: Tensor, q_land: Tensor, k_land: Tensor,
                      pinv_iters: int = 6, z: Tensor | None = None) -> Tensor:
    """Nyström attention s(Q K~^T) s(Q~ K~^T)^+ s(Q~ K^T) V (Xiong et al.), scale 1/sqrt(d).

    q: (B, nq, d), k, v: (B, n, d), q_land, k_land: (B, m, d) -> (B, nq, d); z: the landmarks'
    pseudo-inverse (B, m, m) if already computed (e.g. compiled), else ``landmark_pinv``.
    """
    s = 1.0 / math.sqrt(q.shape[-1])
    # s(Q K~^T) formed transposed, normalised over its m rows: torch's softmax over m = 4 rows of
    # the transpose is an order of magnitude faster than over m = 4 last-dim columns
    k1_t = torch.softmax(torch.matmul(k_land, (q * s).transpose(-1, -2)), dim=-2)  # (B, m, nq)
    k3 = torch.softmax(torch.matmul(q_land * s, k.transpose(-1, -2)), dim=-1)     # (B, m, n)
    if z is None:
        z = landmark_pinv(q_land, k_land, pinv_iters)                             # (B, m, m)
    return torch.matmul(k1_t.transpose(-1, -2), torch.matmul(z, torch.matmul(k3, v)))
