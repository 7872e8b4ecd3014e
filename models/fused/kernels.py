"""The compiled CPU kernels, numba: a streamed token in one call instead of hundreds of torch
calls. Every function works in place on numpy views of the step's state (models/stream/), so a
step taken here and a step taken by the torch step leave the same state behind.

Shapes: BH = batch x heads rows (heads folded into the batch, head index fastest), d the head
dimension, n the window, m landmarks; D the model width, F the feed-forward width. Products
accumulate in float32 (like torch's); the continual Nyström running sums are float64.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .numba_cache import share

share()                                                # one cache for every copy of this code
JIT = dict(cache=True, nogil=True, fastmath=True, error_model="numpy")


# ----------------------------------------------------------------------------- layers

@njit(**JIT)
def linear(w, b, x, out):
    """out = w x + b. w: (O, I), b: (O,), x: (I,), out: (O,). Four rows per pass over x (one
    load of x feeds four products; faster than one row at a time)."""
    O, I = w.shape
    o = 0
    while o + 4 <= O:
        a0 = a1 = a2 = a3 = np.float32(0.0)
        for i in range(I):
            xi = x[i]
            a0 += w[o, i] * xi
            a1 += w[o + 1, i] * xi
            a2 += w[o + 2, i] * xi
            a3 += w[o + 3, i] * xi
        out[o], out[o + 1], out[o + 2], out[o + 3] = a0 + b[o], a1 + b[o + 1], a2 + b[o + 2], a3 + b[o + 3]
        o += 4
    while o < O:
        acc = np.float32(0.0)
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
def embed_qkv(token, pre, pos_index, h, qkv):
    """h = embed(token) + pos_table[pos_index]; qkv = in_proj(h). token: (I,), h: (D,), qkv: (3D,);
    pre: (embed weight, embed bias, position table, in-projection weight, its bias)."""
    emb_w, emb_b, pos, in_w, in_b = pre
    linear(emb_w, emb_b, token, h)
    for i in range(h.shape[0]):
        h[i] += pos[pos_index, i]
    linear(in_w, in_b, h, qkv)


@njit(**JIT)
def block_tail(x, attn, out_w, out_b, n1w, n1b, eps1, f1w, f1b, f2w, f2b, n2w, n2b, eps2,
               a, y, hid, f, out):
    """Post-norm block after attention for one token: out = LN2(y + FF(y)), y = LN1(x + W_o attn).
    x, attn, out, a, y, f: (D,), hid: (F,) buffers."""
    linear(out_w, out_b, attn, a)
    for i in range(a.shape[0]):
        a[i] += x[i]
    layer_norm(a, n1w, n1b, eps1, y)
    linear(f1w, f1b, y, hid)
    for i in range(hid.shape[0]):
        if hid[i] < 0:
            hid[i] = 0
    linear(f2w, f2b, hid, f)
    for i in range(f.shape[0]):
        f[i] += y[i]
    layer_norm(f, n2w, n2b, eps2, out)


@njit(**JIT)
def tail_and_head(x, attn, w, eps1, eps2, bufs, logits):
    """Block tail then classifier. w: the 12 block/head weight arrays (see FusedModel)."""
    a, y, hid, f, z = bufs
    block_tail(x, attn, w[0], w[1], w[2], w[3], eps1, w[4], w[5], w[6], w[7], w[8], w[9], eps2,
               a, y, hid, f, z)
    linear(w[10], w[11], z, logits)


# ----------------------------------------------------------------------------- packed weights

# a 1-block model's parameters in backend.pack_parameters' order (rows of its layout)
EMBED_W, EMBED_B, POS, IN_W, IN_B, OUT_W, OUT_B, N1_W, N1_B, F1_W, F1_B, F2_W, F2_B, N2_W, N2_B, \
    HEAD_W, HEAD_B = range(17)


@njit(**JIT)
def mat(w, layout, i):
    """Parameter i of the packed weights w as a (rows, cols) view; layout: (N, 3) offset, rows,
    cols."""
    off, rows, cols = layout[i, 0], layout[i, 1], layout[i, 2]
    return w[off:off + rows * cols].reshape((rows, cols))


@njit(**JIT)
def vec(w, layout, i):
    """Parameter i of the packed weights w as a (cols,) view (a bias or norm weight)."""
    off = layout[i, 0]
    return w[off:off + layout[i, 2]]


@njit(**JIT)
def unpack(w, layout):
    """The packed 1-block model -> (pre, post) as ``embed_qkv`` and ``tail_and_head`` take them.
    One packed buffer is one argument to unbox instead of seventeen."""
    pre = (mat(w, layout, EMBED_W), vec(w, layout, EMBED_B), mat(w, layout, POS),
           mat(w, layout, IN_W), vec(w, layout, IN_B))
    post = (mat(w, layout, OUT_W), vec(w, layout, OUT_B), vec(w, layout, N1_W),
            vec(w, layout, N1_B), mat(w, layout, F1_W), vec(w, layout, F1_B),
            mat(w, layout, F2_W), vec(w, layout, F2_B), vec(w, layout, N2_W),
            vec(w, layout, N2_B), mat(w, layout, HEAD_W), vec(w, layout, HEAD_B))
    return pre, post


@njit(**JIT)
def scratch_views(s, D, F):
    """One float32 scratch buffer s (9 D + F,) as h (D,), qkv (3 D,), attn (D,) and the block
    tail's buffers (a, y, hid (F,), f, z)."""
    h, qkv, attn = s[:D], s[D:4 * D], s[4 * D:5 * D]
    bufs = (s[5 * D:6 * D], s[6 * D:7 * D], s[7 * D:7 * D + F], s[7 * D + F:8 * D + F],
            s[8 * D + F:9 * D + F])
    return h, qkv, attn, bufs


# ----------------------------------------------------------------------------- exact attention

@njit(**JIT)
def continual_step(q, k, v, ring_k, ring_v, slot, n_t, scores, out):
    """Continual single-output SDA: write the newest key/value into ``slot``, attend the newest
    query over the n_t stored tokens. q, k, v, out: (BH, d); ring_*: (BH, n, d); scores: (n,)."""
    BH, d = q.shape
    scale = np.float32(1.0 / math.sqrt(d))
    for b in range(BH):
        for j in range(d):
            ring_k[b, slot, j] = k[b, j]
            ring_v[b, slot, j] = v[b, j]
        top = -np.inf
        for t in range(n_t):
            s = np.float32(0.0)
            for j in range(d):
                s += (q[b, j] * scale) * ring_k[b, t, j]
            scores[t] = s
            top = max(top, s)
        total = np.float32(0.0)
        for t in range(n_t):
            e = np.float32(math.exp(scores[t] - top))
            scores[t] = e
            total += e
        for j in range(d):
            out[b, j] = 0.0
        for t in range(n_t):
            p = scores[t] / total
            for j in range(d):
                out[b, j] += p * ring_v[b, t, j]


# ----------------------------------------------------------------------------- continual Nyström

@njit(**JIT)
def _fresh_row(b, r, key_scores, ring_v, n_t, ref, den, num, peak):
    """Running sums of row r of sequence b from scratch, from its cached scores."""
    top = -np.inf
    for t in range(n_t):
        top = max(top, np.float64(key_scores[b, t, r]))
    d = num.shape[2]
    for j in range(d):
        num[b, r, j] = 0.0
    total = 0.0
    for t in range(n_t):
        e = math.exp(np.float64(key_scores[b, t, r]) - top)
        total += e
        for j in range(d):
            num[b, r, j] += e * ring_v[b, t, j]
    ref[b, r], den[b, r], peak[b, r] = top, total, total


@njit(**JIT)
def swap_term(b, r, s_out, v_out, full, s, v, ref, den, num, peak, rescale_on):
    """Row r of sequence b loses the departing key (score s_out, value v_out (d,); only when
    ``full``) and takes the newest (score s, value v (d,)) in one pass over the row; scores in the
    row's dtype. With ``rescale_on`` a score above the row's reference first rescales the row
    (returns True) and the peak is tracked (models/running_sums: remove_key then add_key, one
    row, equal up to rounding)."""
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
def nystrom_update(q, k, v, ring_q, ring_k, ring_v, key_scores, ref, den, num, peak, q_scaled,
                   seg_q, seg_k, slot, full, n_t, track, rescale_on, refresh_on, tau):
    """The running sums' part of a steady continual Nyström step (no landmark change), every row.

    Each of the m running sums swaps the departing key (its cached score) for the newest
    (rescaling a row whose reference rises when ``rescale_on``), the token is stored, rows whose
    denominator fell below ``tau`` x its peak are refreshed from cached scores (``refresh_on``).
    ``track``: add q, k to the landmark segment sums. q, k, v: (BH, d); ring_*: (BH, n, d);
    key_scores: (BH, n, m); ref, den, peak: (BH, m) float64; num: (BH, m, d) float64; q_scaled:
    (BH, m, d); seg_*: (BH, d). Returns (any row rescaled, rows refreshed).
    """
    BH, d = q.shape
    m = q_scaled.shape[1]
    rescaled, refreshed = False, 0
    for b in range(BH):
        for r in range(m):
            s = np.float32(0.0)
            for j in range(d):
                s += q_scaled[b, r, j] * k[b, j]
            if swap_term(b, r, np.float64(key_scores[b, slot, r]), ring_v[b, slot], full,
                         np.float64(s), v[b], ref, den, num, peak, rescale_on):
                rescaled = True
            key_scores[b, slot, r] = s
        for j in range(d):
            ring_q[b, slot, j] = q[b, j]
            ring_k[b, slot, j] = k[b, j]
            ring_v[b, slot, j] = v[b, j]
            if track:
                seg_q[b, j] += q[b, j]
                seg_k[b, j] += k[b, j]
        if refresh_on:
            for r in range(m):
                if den[b, r] < tau * peak[b, r]:
                    _fresh_row(b, r, key_scores, ring_v, n_t, ref, den, num, peak)
                    refreshed += 1
    return rescaled, refreshed


@njit(**JIT)
def nystrom_step(q, k, v, ring_q, ring_k, ring_v, key_scores, ref, den, num, peak,
                 q_scaled, k_scaled_t, z, seg_q, seg_k, slot, full, n_t, track,
                 rescale_on, refresh_on, tau, buf, out):
    """One steady continual Nyström step (no landmark change) for every row, single-output:
    ``nystrom_update``, then out = s(q K~^T) Z (num / den). k_scaled_t: (BH, d, m); z: (BH, m, m)
    float64 (the pseudo-inverse's float32 values); buf: (3, m) float64; out: (BH, d); the rest
    as in ``nystrom_update``. Returns its flags.
    """
    BH, d = q.shape
    m = z.shape[1]
    flags = nystrom_update(q, k, v, ring_q, ring_k, ring_v, key_scores, ref, den, num, peak,
                           q_scaled, seg_q, seg_k, slot, full, n_t, track, rescale_on, refresh_on,
                           tau)
    for b in range(BH):
        # out = s(q K~^T) Z / den @ num
        logit, c = buf[0], buf[1]
        top = -np.inf
        for r in range(m):
            s = np.float32(0.0)
            for j in range(d):
                s += q[b, j] * k_scaled_t[b, j, r]
            logit[r] = s
            top = max(top, logit[r])
        total = 0.0
        for r in range(m):
            logit[r] = np.float32(math.exp(logit[r] - top))
            total += logit[r]
        for r in range(m):
            acc = 0.0
            for s_ in range(m):
                acc += (logit[s_] / total) * z[b, s_, r]
            c[r] = acc / den[b, r]
        for j in range(d):
            acc = 0.0
            for r in range(m):
                acc += c[r] * num[b, r, j]
            out[b, j] = acc
    return flags


# ----------------------------------------------------------------------------- whole model steps

@njit(**JIT)
def model_steps_continual(tokens, rows, t, w, layout, eps1, eps2, scratch, k_ring, v_ring, period,
                          scores, logits):
    """1-block continual models, one token of each stream: embed, in-projection, continual
    single-output SDA over every head, out-projection, block tail, classifier. tokens (S, I);
    rows (S,) each stream's row of the state; t (S,) its position; k_ring, v_ring (C, H, n, dh);
    logits (S, classes). w, layout: the packed weights; scratch: see ``scratch_views``."""
    pre, post = unpack(w, layout)
    H, n, dh = k_ring.shape[1], k_ring.shape[2], k_ring.shape[3]
    D = H * dh
    h, qkv, attn, bufs = scratch_views(scratch, D, layout[F1_B, 2])
    for i in range(tokens.shape[0]):
        r, ti = rows[i], t[i]
        embed_qkv(tokens[i], pre, ti % period, h, qkv)
        q = qkv[:D].reshape((H, dh))
        k = qkv[D:2 * D].reshape((H, dh))
        v = qkv[2 * D:].reshape((H, dh))
        continual_step(q, k, v, k_ring[r], v_ring[r], ti % n, min(ti + 1, n), scores, attn.reshape((H, dh)))
        tail_and_head(h, attn, post, eps1, eps2, bufs, logits[i])


@njit(**JIT)
def model_steps_nystrom(tokens, rows, t, w, layout, eps1, eps2, scratch, ring_q, ring_k, ring_v, key_scores,
                        ref, den, num, peak, q_scaled, k_scaled_t, z64, shared, seg_q, seg_k, seg_count,
                        period, track, rescale_on, refresh_on, tau, buf, logits, events):
    """1-block continual Nyström models, one steady token of each stream (no landmark change):
    ``nystrom_step`` between the embedding and in-projection and the block tail and classifier.
    State arrays (C, H, ...) as models/stream/nystrom.NystromState; q_scaled, k_scaled_t, z64:
    the landmarks, one set for all streams where ``shared`` (fixed landmarks: (1, H, ...)),
    else each stream's row; ``track``: the segment sums take the token (continual landmarks).
    events (S, 4) int64: the step's (rebuilt 0, replaced 0, rows refreshed, rescaled)."""
    pre, post = unpack(w, layout)
    H, n, dh = ring_k.shape[1], ring_k.shape[2], ring_k.shape[3]
    D = H * dh
    h, qkv, attn, bufs = scratch_views(scratch, D, layout[F1_B, 2])
    for i in range(tokens.shape[0]):
        r, ti = rows[i], t[i]
        marks = 0 if shared else r
        embed_qkv(tokens[i], pre, ti % period, h, qkv)
        q = qkv[:D].reshape((H, dh))
        k = qkv[D:2 * D].reshape((H, dh))
        v = qkv[2 * D:].reshape((H, dh))
        rescaled, refreshed = nystrom_step(q, k, v, ring_q[r], ring_k[r], ring_v[r], key_scores[r], ref[r],
                                           den[r], num[r], peak[r], q_scaled[marks], k_scaled_t[marks],
                                           z64[marks], seg_q[r], seg_k[r], ti % n, ti >= n, min(ti + 1, n),
                                           track, rescale_on, refresh_on, tau, buf, attn.reshape((H, dh)))
        if track:
            seg_count[r] += 1
        events[i, 0], events[i, 1], events[i, 2], events[i, 3] = 0, 0, refreshed, rescaled
        tail_and_head(h, attn, post, eps1, eps2, bufs, logits[i])
