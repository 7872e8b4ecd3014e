"""The musicnn front end's branches as the continual push computes them, exactly.

Each patch is zero-padded at its own edges, so not everything can be reused as is. Per kind of
branch (both are convolutions in time followed by per-frame operations):

* timbral (7-frame kernels, 81 % of the network): a patch row whose 7-frame context lies inside
  the patch has the same value in every patch that holds it. Those *interior* rows are cached per
  stream frame; a hop computes the rows that became interior and the 3 + 3 edge rows that see the
  patch's zero padding, in one matrix product (im2col) per branch: ``timbral_features``;
* temporal (128/64/32-frame kernels, where most rows see an edge): a branch either recomputes the
  k + K - 1 rows a hop changes and keeps only its features, or keeps the pre-activations of its
  edge rows and updates them like continual attention: the frames leaving the patch *subtracted*
  from the rows whose window held them, the new frames *added* to the rows whose window now
  reaches them. An interior row's pre-activations do not change while it is interior, so only its
  features are kept, and when it becomes a start-edge row its sum is computed from the patch. Per
  row either is the zero-padded 'same' convolution of the patch, exactly; every update is a
  product with a (masked) Toeplitz matrix of the kernel taps: ``toeplitz_taps``;
* every channel's weights are negated where its batch norm's scale is negative (``SignedBN``),
  so that one max over frequency gives BN(ReLU(.)) of the branch's features.

The mid-end and back-end (4 % of the work) are recomputed every hop (audio/musicnn/batch.py
caches the first mid-end convolution's timbral part).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from . import BANDS, TEMPORAL, TIMBRAL, TIMBRAL_CH, TIMBRAL_COLS, Musicnn, product_dtype


class SignedBN:
    """A batch norm's per-channel (sign, scale, shift), computed once per network."""

    def __init__(self, bn):
        self.scale, self.shift = bn.scale_shift()
        self.sign = torch.where(self.scale >= 0, 1.0, -1.0)

    def max_relu(self, zs: Tensor, dim: int) -> Tensor:
        """max over ``dim`` of BN(ReLU(z)) given zs = sign * z (channels last), from one max:
        for a channel with a negative BN scale the max of the result is BN(ReLU(min z)), and
        min z = -max(-z) exactly. (The reference network takes the max and the min of z.)"""
        return self.after_max(zs.amax(dim=dim))

    def after_max(self, m: Tensor) -> Tensor:
        """BN(ReLU(.)) of the maxima m = max zs (channels last)."""
        return F.relu(m * self.sign) * self.scale + self.shift


def timbral_branches(net: Musicnn) -> list[tuple]:
    """Each timbral branch as (w, SignedBN, weight (7 w, TIMBRAL_COLS) in ``product_dtype``, bias
    (204,)), each channel's weights and bias times its sign. The product has TIMBRAL_COLS = 208
    columns, the 204 filters and 4 of zeros: with a multiple of 16 columns torch's CPU matrix
    product runs faster for the same 204 useful ones, for 2 % more multiply-accumulates
    (docs/benchmarks.md, design measurements)."""
    out = []
    for conv, bn, w in zip(net.timbral, net.timbral_bn, TIMBRAL):
        sbn = SignedBN(bn)
        weight = F.pad(conv.weight.flatten(1).t() * sbn.sign, (0, TIMBRAL_COLS - TIMBRAL_CH))   # (7 w, 208)
        out.append((w, sbn, weight.to(product_dtype(net.precision)).contiguous(), conv.bias * sbn.sign))
    return out


def temporal_branches(net: Musicnn) -> list[tuple]:
    """Each temporal branch as (K, SignedBN, weight (C', 1, K, 1), bias (C',), taps w (K, C')),
    each channel's weights and bias times its sign."""
    out = []
    for conv, bn, kernel in zip(net.temporal, net.temporal_bn, TEMPORAL):
        sbn = SignedBN(bn)
        weight = conv.weight * sbn.sign.view(-1, 1, 1, 1)
        out.append((kernel, sbn, weight, conv.bias * sbn.sign, weight[:, 0, :, 0].t().contiguous()))
    return out


def timbral_features(branch: tuple, cols: Tensor) -> Tensor:
    """One timbral branch (``timbral_branches``) on its im2col rows cols (R F, 7 w) in the weights'
    dtype -> (R, 204) float32 features: one matrix product, the max over the F frequency
    positions, the zero filters that pad the product dropped, then the bias (max z + b =
    max (z + b): rounding is monotone, so in floats too) and BN(ReLU(.))."""
    w, bn, weight, bias = branch
    z = (cols @ weight).view(-1, BANDS - w + 1, TIMBRAL_COLS)
    return bn.after_max(z.amax(dim=1)[:, :TIMBRAL_CH].float() + bias)


def toeplitz_taps(w: Tensor, before: int, rows: range, frames: range, skip_old_rows_below: int | None = None) -> Tensor:
    """(len(rows) * C, len(frames)) from the taps w (K, C): the weight of frame f in row r (tap
    f - r + before; zero outside the kernel, and for rows < ``skip_old_rows_below`` zero on frames
    that are not new, i.e. below that same index). Rows r-major, channels within."""
    K = len(w)
    r = torch.arange(rows.start, rows.stop, device=w.device)[:, None]
    f = torch.arange(frames.start, frames.stop, device=w.device)[None, :]
    j = f - r + before                                                # (R, F)
    ok = (j >= 0) & (j < K)
    if skip_old_rows_below is not None:
        ok &= ~((r < skip_old_rows_below) & (f < skip_old_rows_below))
    taps = w[j.clamp(0, K - 1)] * ok[..., None]                       # (R, F, C)
    return taps.permute(0, 2, 1).reshape(-1, len(frames)).contiguous()
