"""The continual musicnn front end: one taggram per 0.25 s hop, over the latest 187 mel frames,
computing only what the hop changes.

Each patch is zero-padded at its own edges, so not everything can be reused as is. Two exact
schemes, one per kind of branch (both are convolutions in time followed by per-frame operations):

* timbral (7-frame kernels, 81 % of the network): a patch row whose 7-frame context lies inside
  the patch has the same value in every patch that holds it. Those *interior* rows are cached per
  stream frame; a hop computes only the 15-16 rows that became interior plus the 3 + 3 edge rows
  that see the patch's zero padding, in one matrix product.
* temporal (128/64/32-frame kernels, where most rows see an edge): the pre-activation of every
  patch row is kept as a sum over the patch's frames and updated like continual attention: the
  hop's frames leaving the patch are *subtracted* from the rows whose window held them, the new
  frames *added* to the rows whose window now reaches them, and only the new rows computed in
  full. Per row this is the zero-padded 'same' convolution of the patch, exactly.

The mid-end and back-end (4 % of the work) are recomputed. The result equals ``Musicnn`` on the
same 187 frames (tested per hop, float32 rounding only) at about a ninth of its
multiply-accumulates.

Before the stream has 187 frames the patch is completed with digital silence (log-mel 0) in
front, i.e. the stream behaves as if preceded by silence.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from . import (BANDS, precision, product_dtype, PATCH_FRAMES, TEMPORAL, TEMPORAL_CH, TIMBRAL, TIMBRAL_CH, TIMBRAL_COLS, Musicnn,
                      head_macs, patch_macs, same_padding, timbral_macs_per_frame)


class SignedBN:
    """A batch norm's per-channel (sign, scale, shift), computed once per stream."""

    def __init__(self, bn):
        self.scale, self.shift = bn.scale_shift()
        self.sign = torch.where(self.scale >= 0, 1.0, -1.0)

    def max_relu(self, zs: Tensor, dim: int) -> Tensor:
        """max over ``dim`` of BN(ReLU(z)) given zs = sign * z (channels last), from one max:
        for a channel with a negative BN scale the max of the result is BN(ReLU(min z)), and
        min z = -max(-z) exactly. (The batch network takes the max and the min of z.)"""
        return self.after_max(zs.amax(dim=dim))

    def after_max(self, m: Tensor) -> Tensor:
        """BN(ReLU(.)) of the maxima m = max zs (channels last)."""
        return F.relu(m * self.sign) * self.scale + self.shift


def timbral_features(branch: tuple, cols: Tensor) -> Tensor:
    """One timbral branch (w, bn, weight (7 w, TIMBRAL_COLS), bias (204,)) on its im2col rows
    cols (R F, 7 w) in the weights' dtype -> (R, 204) float32 features: one matrix product, the
    max over the F frequency positions, the zero filters that pad the product dropped, then the
    bias (max z + b = max (z + b): rounding is monotone, so in floats too) and BN(ReLU(.))."""
    w, bn, weight, bias = branch
    z = (cols @ weight).view(-1, BANDS - w + 1, TIMBRAL_COLS)
    return bn.after_max(z.amax(dim=1)[:, :TIMBRAL_CH].float() + bias)


class TimbralCache:
    """Both timbral branches over the patch. ``rows[p]`` holds the stream value of patch row p
    for interior rows (3 <= p <= 183); edge rows are recomputed with the patch's zero padding.
    All the rows a hop needs go through one matrix product per branch (im2col), with each
    channel's weights negated where its batch-norm scale is negative (see SignedBN). The
    product has TIMBRAL_COLS = 208 columns, the 204 filters and 4 of zeros: with a multiple of
    16 columns torch's CPU matrix product runs faster for the same 204 useful ones, for 2 % more
    multiply-accumulates (docs/benchmarks.md, design measurements). The product's operands
    are in ``product_dtype`` of the network's precision (``dtype``)."""
    EDGE = 3

    def __init__(self, net: Musicnn):
        self.branches, self.dtype = [], product_dtype(net.precision)
        for conv, bn, w in zip(net.timbral, net.timbral_bn, TIMBRAL):
            sbn = SignedBN(bn)
            pad = TIMBRAL_COLS - TIMBRAL_CH
            weight = F.pad(conv.weight.flatten(1).t() * sbn.sign, (0, pad))          # (7 w, 208)
            self.branches.append((w, sbn, weight.to(self.dtype).contiguous(), conv.bias * sbn.sign))

    def segments(self, xs: list[Tensor]) -> list[Tensor]:
        """(L_i, 96) normalised segments (padding in place) -> [(L_i - 6, 408)]."""
        sizes = [len(x) - 6 for x in xs]
        outs = []
        for branch in self.branches:
            w = branch[0]
            cols = torch.cat([x.to(self.dtype).unfold(0, 7, 1).unfold(1, w, 1).reshape(-1, 7 * w) for x in xs])
            outs.append(timbral_features(branch, cols))
        return list(torch.cat(outs, dim=1).split(sizes))

    def reset(self, patch: Tensor) -> None:
        one = self.segments([patch[:2 * self.EDGE + 1]])[0]                  # (1, 408): silence
        self.rows = one.expand(PATCH_FRAMES, -1).clone()

    def update(self, patch: Tensor, k: int) -> tuple[Tensor, int]:
        """The patch moved by k new frames -> ((187, 408) features, rows computed now)."""
        e, P = self.EDGE, PATCH_FRAMES
        zeros = patch.new_zeros(e, BANDS)
        segments = [torch.cat([zeros, patch[:2 * e]]), torch.cat([patch[-2 * e:], zeros])]
        jump = k > P - 2 * e - 1
        if jump:                                       # every interior row is new
            segments.append(patch)
        elif k:                                        # rows P-3-k .. P-4 became interior
            segments.append(patch[P - k - 2 * e:])
        head, tail, *fresh = self.segments(segments)
        if jump:
            self.rows[e:P - e] = fresh[0]
        elif k:
            self.rows = torch.cat([self.rows[k:P - e], fresh[0], self.rows[P - e:]])
        computed = 2 * e + (len(fresh[0]) if fresh else 0)
        return torch.cat([head, self.rows[e:P - e], tail]), computed


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


class TemporalAccumulator:
    """Pre-activations of one temporal branch over the zero-padded patch, kept in a ring of
    patch rows ``z`` (187, C, 96) and updated per hop by subtracting leaving and adding arriving
    frames, each update one matrix product with a (masked) Toeplitz matrix of the kernel taps.
    Each channel is stored times the sign of its batch-norm scale (see SignedBN)."""

    def __init__(self, conv, bn, kernel: int):
        self.bn, self.K = SignedBN(bn), kernel
        self.before, self.after = same_padding(kernel)
        sign = self.bn.sign
        self.weight = conv.weight * sign.view(-1, 1, 1, 1)            # (C, 1, K, 1)
        self.bias = conv.bias * sign
        self.w = self.weight[:, 0, :, 0].t().contiguous()             # (K, C): tap j, channel
        self._taps: dict = {}

    def reset(self, patch: Tensor) -> None:
        x = F.pad(patch, (0, 0, self.before, self.after))[None, None]
        z = F.conv2d(x, self.weight, self.bias)[0]                     # (C, 187, 96)
        self.z = z.transpose(0, 1).contiguous()                       # (187, C, 96)
        self.start = 0                                                # ring slot of patch row 0

    def _toeplitz(self, key, rows: range, frames: range, skip_old_rows_below: int | None = None) -> Tensor:
        if key not in self._taps:
            self._taps[key] = toeplitz_taps(self.w, self.before, rows, frames, skip_old_rows_below)
        return self._taps[key]

    def _ring(self, rows: range) -> list[tuple[slice, slice]]:
        """(ring slots, positions in ``rows``) as at most two contiguous slices."""
        first, n, P = (self.start + rows.start) % PATCH_FRAMES, len(rows), PATCH_FRAMES
        if first + n <= P:
            return [(slice(first, first + n), slice(0, n))]
        return [(slice(first, P), slice(0, P - first)), (slice(0, first + n - P), slice(P - first, n))]

    def _add(self, rows: range, delta: Tensor, alpha: float = 1.0) -> None:
        for ring, part in self._ring(rows):
            self.z[ring].add_(delta[part], alpha=alpha)

    def shift(self, old: Tensor, patch: Tensor, k: int) -> int:
        """The patch moved from ``old`` to ``patch`` by k frames; returns rows recomputed whole
        (0, or 187 after a jump longer than the patch minus a kernel)."""
        P, b, a = PATCH_FRAMES, self.before, self.after
        if k == 0:
            return 0
        if k > P - self.K:                                            # a jump: start again
            self.reset(patch)
            return P
        # frames 0..k-1 of the old patch leave the windows of old rows k .. k+b-1
        out = self._toeplitz(("out", k), range(k, k + b), range(0, k)) @ old[:k]
        self._add(range(k, k + b), out.view(b, -1, BANDS), alpha=-1.0)
        self.start = (self.start + k) % P                             # old row p is now p - k
        # new frames P-k .. P-1 join rows P-k-a .. P-k-1; the new rows P-k .. P-1 get all their
        # frames (P-k-b .. P-1): one product over frames P-k-b .. P-1, old-row/old-frame zeroed
        for ring, _ in self._ring(range(P - k, P)):
            self.z[ring] = self.bias.view(-1, 1)
        rows = range(P - k - a, P)
        inc = self._toeplitz(("in", k), rows, range(P - k - b, P), skip_old_rows_below=P - k)
        self._add(rows, (inc @ patch[P - k - b:]).view(len(rows), -1, BANDS))
        return 0

    def macs(self, k: int, full: int) -> int:
        """Multiply-accumulates of the last ``shift`` (dense products, masked taps included)."""
        C, b, a = TEMPORAL_CH * BANDS, self.before, self.after
        if full:
            return C * full * self.K
        return C * (b * k + (a + k) * (k + b)) if k else 0

    def features(self) -> Tensor:
        """(187, C): max over frequency of BN(ReLU(z)), patch row order."""
        rows = self.bn.max_relu(self.z, dim=2)                        # (187, C) in ring order
        return rows.roll(-self.start, dims=0)


class MusicnnStream:
    """``push(frames (k, 96))`` -> taggram (50,) of the newest 187 frames; ``reset()``.
    ``continual=False`` recomputes the whole patch each hop (the reference and baseline)."""

    def __init__(self, net: Musicnn, *, continual: bool = True):
        self.net, self.continual = net, continual
        self.device = next(net.buffers()).device
        self.timbral = TimbralCache(net)
        self.temporal = [TemporalAccumulator(conv, bn, k)
                         for conv, bn, k in zip(net.temporal, net.temporal_bn, TEMPORAL)]
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """The caches of a patch of silence, computed in the network's precision like every push
        (on CUDA outside it, cuDNN's TF32 convolutions would put every taggram whose patch
        still holds that silence past the float32 error bound)."""
        with precision(self.net.precision, self.device):
            silence = torch.zeros(1, PATCH_FRAMES, BANDS, device=self.device)
            self.patch = self.net.normalize(silence)[0]                   # (187, 96) normalised
            self.timbral.reset(self.patch)
            for acc in self.temporal:
                acc.reset(self.patch)
        self.last_macs = 0

    @torch.no_grad()
    def push(self, frames: np.ndarray | Tensor) -> Tensor:
        """frames: (k, 96) new log-mel frames (k may be 0) -> (50,) taggram of the patch."""
        with precision(self.net.precision, self.device):
            return self._push(frames)

    def _push(self, frames: np.ndarray | Tensor) -> Tensor:
        new = torch.as_tensor(np.asarray(frames, dtype=np.float32), device=self.device)
        k = min(len(new), PATCH_FRAMES)
        old = self.patch
        if k:
            self.patch = torch.cat([old[k:], self.net.normalize(new[None, -k:])[0]])
        if not self.continual:
            x = self.patch[None]
            front = torch.cat([self.net.timbral_valid(F.pad(x, (0, 0, 3, 3))),
                               self.net.temporal_same(x)], dim=2)
            self.last_macs = patch_macs()
            return torch.sigmoid(self.net.head(front))[0]
        timbral, rows = self.timbral.update(self.patch, k)
        macs = head_macs() + rows * timbral_macs_per_frame(TIMBRAL_COLS)
        feats = [timbral]
        for acc in self.temporal:
            full = acc.shift(old, self.patch, k)
            feats.append(acc.features())
            macs += acc.macs(k, full)
        self.last_macs = macs
        return torch.sigmoid(self.net.head(torch.cat(feats, dim=1)[None]))[0]
