"""The landmarks' pseudo-inverse pinv(s(Q~ K~^T / sqrt(d))) in one compiled call.

Same arithmetic as models/sda/reference.landmark_pinv (the oracle): the m x m kernel and the
iteration in float64, Z0 = A^T / (max column sum * max row sum) per matrix, then
Z <- 1/4 Z (13 I - A Z (15 I - A Z (7 I - A Z))). In torch it is ~60 calls on (B, 4, 4) matrices;
here one (`bench`: the recomputing `nystrom` model's (fused) row). Tested equal to the oracle.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit
from torch import Tensor

from .kernels import JIT


@njit(**JIT)
def _matmul(a, b, out):
    m = a.shape[0]
    for i in range(m):                 # row-wise (independent accumulators, not one chain)
        for j in range(m):
            out[i, j] = a[i, 0] * b[0, j]
        for r in range(1, m):
            air = a[i, r]
            for j in range(m):
                out[i, j] += air * b[r, j]


@njit(**JIT)
def _pinv_one(a, iters, z, az, t, u):
    """z = pinv(a) for one (m, m) float64 matrix; az, t, u: (m, m) scratch."""
    m = a.shape[0]
    col = 0.0
    row = 0.0
    for i in range(m):
        cs = 0.0
        rs = 0.0
        for j in range(m):
            cs += abs(a[j, i])
            rs += abs(a[i, j])
        col = max(col, cs)
        row = max(row, rs)
    norm = col * row
    for i in range(m):
        for j in range(m):
            z[i, j] = a[j, i] / norm
    for _ in range(iters):
        _matmul(a, z, az)
        for i in range(m):                             # t = 7 I - AZ
            for j in range(m):
                t[i, j] = (7.0 if i == j else 0.0) - az[i, j]
        _matmul(az, t, u)                              # u = 15 I - AZ t
        for i in range(m):
            for j in range(m):
                u[i, j] = (15.0 if i == j else 0.0) - u[i, j]
        _matmul(az, u, t)                              # t = 13 I - AZ u
        for i in range(m):
            for j in range(m):
                t[i, j] = (13.0 if i == j else 0.0) - t[i, j]
        _matmul(z, t, u)                               # z = 1/4 z t
        for i in range(m):
            for j in range(m):
                z[i, j] = 0.25 * u[i, j]


@njit(**JIT)
def landmark_pinv_arrays(q_land, k_land, iters, z64, z32):
    """q_land, k_land: (B, m, d) float32 -> z64 (B, m, m) float64 and z32 its float32 copy."""
    B, m, d = q_land.shape
    s = 1.0 / math.sqrt(d)
    a = np.empty((m, m))
    az, t, u = np.empty((m, m)), np.empty((m, m)), np.empty((m, m))
    for b in range(B):
        for i in range(m):
            top = -np.inf
            for j in range(m):
                acc = 0.0
                for r in range(d):
                    acc += np.float64(q_land[b, i, r]) * np.float64(k_land[b, j, r])
                a[i, j] = acc * s
                top = max(top, a[i, j])
            total = 0.0
            for j in range(m):
                a[i, j] = math.exp(a[i, j] - top)
                total += a[i, j]
            for j in range(m):
                a[i, j] /= total
        _pinv_one(a, iters, z64[b], az, t, u)
        for i in range(m):
            for j in range(m):
                z32[b, i, j] = z64[b, i, j]


@njit(**JIT)
def pinv_arrays(a, iters, z):
    """z = pinv(a) for (B, m, m) float64 matrices."""
    m = a.shape[1]
    az, t, u = np.empty((m, m)), np.empty((m, m)), np.empty((m, m))
    for b in range(a.shape[0]):
        _pinv_one(a[b], iters, z[b], az, t, u)


def pinv64(a: Tensor, iters: int) -> Tensor:
    """models/sda/reference.pinv of (..., m, m) float64 CPU matrices, in one compiled call."""
    m = a.shape[-1]
    flat = a.detach().reshape(-1, m, m).contiguous().numpy()
    z = np.empty_like(flat)
    pinv_arrays(flat, int(iters), z)
    return torch.from_numpy(z).view(a.shape)


def landmark_pinv(q_land: Tensor, k_land: Tensor, iters: int) -> tuple[Tensor, Tensor]:
    """(B, m, d) float32 CPU landmarks -> (z float32, z64 float64), each (B, m, m)."""
    q = q_land.detach().contiguous().numpy()
    k = k_land.detach().contiguous().numpy()
    B, m = q.shape[:2]
    z64, z32 = np.empty((B, m, m)), np.empty((B, m, m), np.float32)
    landmark_pinv_arrays(q, k, int(iters), z64, z32)
    return torch.from_numpy(z32), torch.from_numpy(z64)
