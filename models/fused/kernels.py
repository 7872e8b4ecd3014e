"""The compiled CPU kernels (numba): a streamed token in one call instead of hundreds of torch
calls. They read and write the step's own state in place and by name: a state NamedTuple of
models/stream/ (``SingleOutputState``, ``RetroactiveState``, ``NystromState``) whose fields are
numpy views of the torch step's tensors, every stream's row at once (stream row r of each
field), so that a step taken here and one taken by the torch step leave the same state behind.

The landmarks a step uses are a ``Landmarks`` (models/stream/nystrom.py) of numpy arrays, the
weights the model's ``Packed`` buffer, the step's settings a ``Config``.

- per head, shared by 1 and 2 blocks: ``swap_term`` (a row of running sums loses the departing
  key and takes the newest), ``fresh_row`` (a row from its cached scores), ``landmark_probs``
  (s(q K~^T));
- per stream: ``attend_single`` (continual single-output), ``nystrom_update`` and
  ``nystrom_attend`` (a steady continual Nyström step);
- layers over the model's packed weights (``Packed``): ``embed_qkv``, ``block_tail``, ``classify``;
- whole 1-block steps of every stream of a call: ``single_output_steps``, ``nystrom_steps``.

Shapes: C rows of state, H heads of dh, D = H dh, F the feed-forward width, n the window, m
landmarks. Products accumulate in float32 (like torch's); the Nyström running sums are float64.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from ..stream.nystrom import Landmarks
from .numba_cache import share

share()                                                # one cache for every copy of this code
JIT = dict(cache=True, nogil=True, fastmath=True, error_model="numpy")
F32 = np.float32


class Packed(NamedTuple):
    """A model's parameters in one float32 buffer (backend.pack_parameters): parameter i is
    buffer[offset:offset + rows * cols] with layout[i] = (offset, rows, cols)."""
    buffer: np.ndarray
    layout: np.ndarray


class Config(NamedTuple):
    """What a compiled step reads besides weights and state."""
    period: int          # rows of the position table (position index = t mod period)
    eps: float           # every LayerNorm's epsilon
    rescale: bool        # the stability measures (models/stream/sums.py Stability)
    refresh: bool
    tau: float           # a row is refreshed when den < tau * peak
    track: bool          # continual landmarks: the segment sums take each token
    iters: int           # pseudo-inverse iterations (block 2's continual landmarks)


def arrays(named, fixed=None) -> tuple:
    """A named state of torch tensors (CPU, contiguous, no two sharing memory) as the kernels
    take it: the same NamedTuple of numpy views, and its landmarks (``fixed``: Landmarks of
    numpy arrays; else a Nyström state's own, None for exact attention)."""
    s = type(named)(*(x.numpy() for x in named))
    if fixed is None and hasattr(s, "z64"):
        fixed = Landmarks(s.q_scaled, s.k_scaled_t, s.z64)
    return s, fixed


# the packed parameters, in backend.model_parameters' order: the model's, then each block's
EMBED_W, EMBED_B, POS, HEAD_W, HEAD_B = range(5)
IN_W, IN_B, OUT_W, OUT_B, N1_W, N1_B, F1_W, F1_B, F2_W, F2_B, N2_W, N2_B = range(12)
FIRST_BLOCK, PER_BLOCK = 5, 12


@njit(**JIT)
def mat(p, i):
    """Parameter i of the packed weights as a (rows, cols) view."""
    off, rows, cols = p.layout[i, 0], p.layout[i, 1], p.layout[i, 2]
    return p.buffer[off:off + rows * cols].reshape((rows, cols))


@njit(**JIT)
def vec(p, i):
    """Parameter i of the packed weights as a (cols,) view (a bias or norm weight)."""
    off = p.layout[i, 0]
    return p.buffer[off:off + p.layout[i, 2]]


@njit(**JIT)
def param(block, i):
    """The index of block ``block``'s parameter i (IN_W ... N2_B)."""
    return FIRST_BLOCK + PER_BLOCK * block + i


@njit(**JIT)
def row(marks, r):
    """The landmarks' row for stream row r: 0 where they are shared (fixed)."""
    return 0 if marks.z.shape[0] == 1 else r


# ----------------------------------------------------------------------------- layers

@njit(**JIT)
def linear(w, b, x, out):
    """out = w x + b. w: (O, I), b: (O,), x: (I,), out: (O,). Four rows per pass over x (one
    load of x feeds four products; faster than one row at a time)."""
    O, I = w.shape
    o = 0
    while o + 4 <= O:
        a0 = a1 = a2 = a3 = F32(0.0)
        for i in range(I):
            xi = x[i]
            a0 += w[o, i] * xi
            a1 += w[o + 1, i] * xi
            a2 += w[o + 2, i] * xi
            a3 += w[o + 3, i] * xi
        out[o], out[o + 1], out[o + 2], out[o + 3] = a0 + b[o], a1 + b[o + 1], a2 + b[o + 2], a3 + b[o + 3]
        o += 4
    while o < O:
        acc = F32(0.0)
        for i in range(I):
            acc += w[o, i] * x[i]
        out[o] = acc + b[o]
        o += 1


@njit(**JIT)
def layer_norm(x, w, b, eps, out):
    """out = LayerNorm(x) * w + b (biased variance, statistics in float64). x, out: (D,)."""
    D = x.shape[0]
    mean = 0.0
    for i in range(D):
        mean += x[i]
    mean /= D
    var = 0.0
    for i in range(D):
        c = x[i] - mean
        var += c * c
    inv = 1.0 / math.sqrt(var / D + eps)
    for i in range(D):
        out[i] = (x[i] - mean) * inv * w[i] + b[i]


@njit(**JIT)
def embed_qkv(token, p, position, h, qkv):
    """h = embed(token) + pos_table[position]; qkv = block 0's in-projection of h.
    token: (I,), h: (D,), qkv: (3D,)."""
    linear(mat(p, EMBED_W), vec(p, EMBED_B), token, h)
    table = mat(p, POS)
    for i in range(h.shape[0]):
        h[i] += table[position, i]
    linear(mat(p, param(0, IN_W)), vec(p, param(0, IN_B)), h, qkv)


@njit(**JIT)
def heads(qkv, H):
    """The packed in-projection (3D,) as q, k, v (H, dh) views."""
    D = qkv.shape[0] // 3
    dh = D // H
    return qkv[:D].reshape((H, dh)), qkv[D:2 * D].reshape((H, dh)), qkv[2 * D:].reshape((H, dh))


@njit(**JIT)
def block_tail(p, block, eps, x, attn, out):
    """Block ``block``'s post-norm tail for one token: out = LN2(y + FF(y)), y = LN1(x + W_o attn
    + b_o). x, attn, out: (D,)."""
    D = x.shape[0]
    a, y, f = np.empty(D, F32), np.empty(D, F32), np.empty(D, F32)
    linear(mat(p, param(block, OUT_W)), vec(p, param(block, OUT_B)), attn, a)
    for i in range(D):
        a[i] += x[i]
    layer_norm(a, vec(p, param(block, N1_W)), vec(p, param(block, N1_B)), eps, y)
    w1 = mat(p, param(block, F1_W))
    hid = np.empty(w1.shape[0], F32)
    linear(w1, vec(p, param(block, F1_B)), y, hid)
    for i in range(hid.shape[0]):
        if hid[i] < 0:
            hid[i] = 0
    linear(mat(p, param(block, F2_W)), vec(p, param(block, F2_B)), hid, f)
    for i in range(D):
        f[i] += y[i]
    layer_norm(f, vec(p, param(block, N2_W)), vec(p, param(block, N2_B)), eps, out)


@njit(**JIT)
def classify(p, x, logits):
    """logits = the classifier of x (D,)."""
    linear(mat(p, HEAD_W), vec(p, HEAD_B), x, logits)


# ----------------------------------------------------------------------------- per head

@njit(**JIT)
def dot(a, b):
    """a . b in float32: a, b (d,)."""
    acc = F32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@njit(**JIT)
def swap_term(b, r, s_out, v_out, full, s, v, ref, den, num, peak, rescale_on):
    """Row r of head b loses the departing key (score s_out, value v_out (dh,); only when
    ``full``) and takes the newest (score s, value v (dh,)) in one pass over the row; scores in
    the row's dtype. With ``rescale_on`` a score above the row's reference first rescales the row
    (returns True) and the peak is tracked (models/stream/sums.py ``slide`` for one row, equal up
    to rounding)."""
    e_out = math.exp(s_out - ref[b, r]) if full else 0.0
    rescaled = False
    if rescale_on and s > ref[b, r]:
        f = math.exp(ref[b, r] - s)
        den[b, r] *= f
        peak[b, r] *= f
        e_out *= f
        for j in range(v.shape[0]):
            num[b, r, j] *= f
        ref[b, r] = s
        rescaled = True
    e_in = math.exp(s - ref[b, r])
    den[b, r] += e_in - e_out
    if full:
        for j in range(v.shape[0]):
            num[b, r, j] += e_in * v[j] - e_out * v_out[j]
    else:                              # v_out is an unused slot: never read it
        for j in range(v.shape[0]):
            num[b, r, j] += e_in * v[j]
    if rescale_on:
        peak[b, r] = max(peak[b, r], den[b, r])
    return rescaled


@njit(**JIT)
def fresh_row(key_scores, values, n_t, b, r, ref, den, num, peak):
    """Row r of head b's running sums from scratch, in the sums' dtype (float64 Nyström rows,
    float32 retroactive ones), from its cached scores key_scores[b, :n_t, r] (key-major) over
    values[b, :n_t] (models/stream/sums.py ``fresh_rows`` for one row)."""
    T = den.dtype.type
    top = T(-np.inf)
    for j in range(n_t):
        top = max(top, T(key_scores[b, j, r]))
    for c in range(num.shape[2]):
        num[b, r, c] = 0.0
    total = T(0.0)
    for j in range(n_t):
        e = T(math.exp(T(key_scores[b, j, r]) - top))
        total += e
        for c in range(num.shape[2]):
            num[b, r, c] += e * values[b, j, c]
    ref[b, r], den[b, r], peak[b, r] = top, total, total


@njit(**JIT)
def landmark_probs(q, k_scaled_t, out):
    """out (m,) = softmax over the landmarks of q k_scaled_t, float32: q (dh,), k_scaled_t (dh, m)."""
    m = out.shape[0]
    top = F32(-np.inf)
    for r in range(m):
        s = F32(0.0)
        for j in range(q.shape[0]):
            s += q[j] * k_scaled_t[j, r]
        out[r] = s
        top = max(top, s)
    total = F32(0.0)
    for r in range(m):
        out[r] = F32(math.exp(out[r] - top))
        total += out[r]
    for r in range(m):
        out[r] /= total


# ----------------------------------------------------------------------------- per stream

@njit(**JIT)
def attend_single(s, r, q, k, v, t, out):
    """Continual single-output SDA of stream row r of ``s`` (SingleOutputState) at position t:
    the newest key and value into slot t % n, the newest query over the stored tokens.
    q, k, v, out: (H, dh)."""
    k_ring, v_ring = s.k_ring[r], s.v_ring[r]
    H, n, dh = k_ring.shape
    slot, n_t = t % n, min(t + 1, n)
    scale = F32(1.0 / math.sqrt(dh))
    scores = np.empty(n, F32)
    for b in range(H):
        for j in range(dh):
            k_ring[b, slot, j] = k[b, j]
            v_ring[b, slot, j] = v[b, j]
        top = -np.inf
        for i in range(n_t):
            acc = F32(0.0)
            for j in range(dh):
                acc += (q[b, j] * scale) * k_ring[b, i, j]
            scores[i] = acc
            top = max(top, acc)
        total = F32(0.0)
        for i in range(n_t):
            e = F32(math.exp(scores[i] - top))
            scores[i] = e
            total += e
        for j in range(dh):
            out[b, j] = 0.0
        for i in range(n_t):
            weight = scores[i] / total
            for j in range(dh):
                out[b, j] += weight * v_ring[b, i, j]


@njit(**JIT)
def nystrom_update(s, r, q_scaled, q, k, v, t, cfg):
    """The running sums' part of a steady continual Nyström step (no landmark change) of stream
    row r of ``s`` (NystromState) at position t: each of the m rows swaps the departing key
    (its cached score) for the newest, the token is stored (and, with ``cfg.track``, counted in
    the segment in progress), rows whose denominator fell below tau x its peak are refreshed
    from cached scores. q_scaled: (H, m, dh) the query landmarks in use; q, k, v: (H, dh).
    Returns (any row rescaled, rows refreshed)."""
    ring_q, ring_k, ring_v, key_scores = s.q_ring[r], s.k_ring[r], s.v_ring[r], s.key_scores[r]
    ref, den, num, peak = s.ref[r], s.den[r], s.num[r], s.peak[r]
    H, n, dh = ring_k.shape
    m = q_scaled.shape[1]
    slot, full, n_t = t % n, t >= n, min(t + 1, n)
    rescaled, refreshed = False, 0
    for b in range(H):
        for i in range(m):
            score = dot(q_scaled[b, i], k[b])
            if swap_term(b, i, np.float64(key_scores[b, slot, i]), ring_v[b, slot], full, np.float64(score), v[b],
                         ref, den, num, peak, cfg.rescale):
                rescaled = True
            key_scores[b, slot, i] = score
        for j in range(dh):
            ring_q[b, slot, j] = q[b, j]
            ring_k[b, slot, j] = k[b, j]
            ring_v[b, slot, j] = v[b, j]
        if cfg.track:
            for j in range(dh):
                s.seg_q[r, b, j] += q[b, j]
                s.seg_k[r, b, j] += k[b, j]
        if cfg.refresh:
            for i in range(m):
                if den[b, i] < cfg.tau * peak[b, i]:
                    fresh_row(key_scores, ring_v, n_t, b, i, ref, den, num, peak)
                    refreshed += 1
    if cfg.track:
        s.seg_count[r] += 1
    return rescaled, refreshed


@njit(**JIT)
def nystrom_attend(s, r, marks, q, k, v, t, cfg, out):
    """A steady continual Nyström step of stream row r, single-output: ``nystrom_update``, then
    out (H, dh) = s(q K~^T) Z (num / den) with ``marks`` (Landmarks, z float64). Returns its flags."""
    j = row(marks, r)
    flags = nystrom_update(s, r, marks.q_scaled[j], q, k, v, t, cfg)
    den, num = s.den[r], s.num[r]
    H, m, dh = num.shape
    probs, c = np.empty(m, F32), np.empty(m)
    for b in range(H):
        landmark_probs(q[b], marks.k_scaled_t[j, b], probs)
        for i in range(m):
            acc = 0.0
            for i2 in range(m):
                acc += np.float64(probs[i2]) * marks.z[j, b, i2, i]
            c[i] = acc / den[b, i]
        for e in range(dh):
            acc = 0.0
            for i in range(m):
                acc += c[i] * num[b, i, e]
            out[b, e] = acc
    return flags


# ----------------------------------------------------------------------------- 1-block model steps

@njit(**JIT)
def single_output_steps(tokens, rows, t, p, cfg, s, logits):
    """1-block continual models, one token of each stream: embedding, in-projection, continual
    single-output SDA over every head, block tail, classifier. tokens (S, I); rows (S,) each
    stream's row of the state ``s`` (SingleOutputState); t (S,) its position; logits (S, classes)."""
    H = s.k_ring.shape[1]
    D = mat(p, EMBED_W).shape[0]
    h, qkv, attn, z = np.empty(D, F32), np.empty(3 * D, F32), np.empty(D, F32), np.empty(D, F32)
    for i in range(tokens.shape[0]):
        embed_qkv(tokens[i], p, t[i] % cfg.period, h, qkv)
        q, k, v = heads(qkv, H)
        attend_single(s, rows[i], q, k, v, t[i], attn.reshape((H, D // H)))
        block_tail(p, 0, cfg.eps, h, attn, z)
        classify(p, z, logits[i])


@njit(**JIT)
def nystrom_steps(tokens, rows, t, p, cfg, s, marks, logits, events):
    """1-block continual Nyström models, one steady token of each stream (no landmark change):
    ``nystrom_attend`` between the embedding and in-projection and the block tail and classifier.
    ``s``: NystromState; ``marks``: the landmarks (fixed: one set; continual: the state's own);
    events (S, 4) int64: the step's (rebuilt 0, replaced 0, rows refreshed, rescaled)."""
    H = s.k_ring.shape[1]
    D = mat(p, EMBED_W).shape[0]
    h, qkv, attn, z = np.empty(D, F32), np.empty(3 * D, F32), np.empty(D, F32), np.empty(D, F32)
    for i in range(tokens.shape[0]):
        embed_qkv(tokens[i], p, t[i] % cfg.period, h, qkv)
        q, k, v = heads(qkv, H)
        rescaled, refreshed = nystrom_attend(s, rows[i], marks, q, k, v, t[i], cfg, attn.reshape((H, D // H)))
        events[i, 0], events[i, 1], events[i, 2], events[i, 3] = 0, 0, refreshed, rescaled
        block_tail(p, 0, cfg.eps, h, attn, z)
        classify(p, z, logits[i])
