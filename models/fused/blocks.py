"""Compiled pieces of the 2-block step (backend.py): a retroactive block 0 over the window's n
rows, then block 1 for the newest token over block 0's outputs, its keys and values folded
(models/stream/window.py). Rows are in ring order (the slot of stream token t is t % n). The
``*_all`` functions take every stream of a call (rows: each stream's row of the state; t: its
position); block 0 reads and writes the step's state by name, as kernels.py does, and shares
its per-head pieces.

Shapes: S streams, H heads of dh, D = H dh the model width, F the feed-forward width, n the
window, m landmarks, R block 1's query rows per head (m landmarks, or 1 query). The products
over all n rows are torch's matrix products, called between these (backend.py).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import kernels as K
from .kernels import F32, IN_B, IN_W, OUT_W, mat, param, vec
from .pinv import landmark_pinv_arrays

JIT = K.JIT


# ----------------------------------------------------------------------------- row blocks
# (between torch's matrix products: backend.py TwoBlockBackend.step)

@njit(**JIT)
def norm_rows(x, a, bias, w, b, eps, out):
    """out[i] = LayerNorm(x[i] + a[i] + bias) * w + b, every row (a is overwritten).
    x, a, out: (R, D); bias, w, b: (D,)."""
    R, D = x.shape
    for i in range(R):
        for c in range(D):
            a[i, c] += x[i, c] + bias[c]
        K.layer_norm(a[i], w, b, eps, out[i])


@njit(**JIT)
def bias_relu(h, bias):
    """h = max(h + bias, 0) in place. h: (R, F); bias: (F,)."""
    R, F = h.shape
    for i in range(R):
        for c in range(F):
            h[i, c] = max(h[i, c] + bias[c], F32(0.0))


# ----------------------------------------------------------------------------- block 0

@njit(**JIT)
def retroactive_update(s, r, q, k, v, t, cfg, attn):
    """Continual retroactive SDA of stream row r of ``s`` (RetroactiveState) at position t, its
    window full after it: per head, the newest query and key into their rings, every row's
    running sums lose the departing key and take the newest (models/stream/sums.py), the newest
    query's row from scratch, stale rows refreshed from cached scores; attn (n, D) = num / den
    of every row, ring order. q, k, v: (H, dh). Returns (any row rescaled, rows refreshed)."""
    ring_q, ring_k, ring_v, key_scores = s.q_ring[r], s.k_ring[r], s.v_ring[r], s.key_scores[r]
    ref, den, num, peak = s.ref[r], s.den[r], s.num[r], s.peak[r]
    H, n, dh = ring_k.shape
    slot = t % n
    scale = F32(1.0 / math.sqrt(dh))
    rescaled, refreshed = False, 0
    for b in range(H):
        for j in range(dh):
            ring_q[b, slot, j] = q[b, j]
            ring_k[b, slot, j] = k[b, j]
        for i in range(n):             # every row: the departing key (cached score) out, new in
            score = K.dot(ring_q[b, i], k[b]) * scale
            if K.swap_term(b, i, key_scores[b, slot, i], ring_v[b, slot], True, score, v[b], ref, den, num, peak,
                           cfg.rescale):
                rescaled = True
            key_scores[b, slot, i] = score
        for j in range(dh):
            ring_v[b, slot, j] = v[b, j]
        for j in range(n):             # the newest query's row, from scratch
            key_scores[b, j, slot] = K.dot(ring_k[b, j], q[b]) * scale
        K.fresh_row(key_scores, ring_v, n, b, slot, ref, den, num, peak)
        if cfg.refresh:
            for i in range(n):
                if den[b, i] < cfg.tau * peak[b, i]:
                    K.fresh_row(key_scores, ring_v, n, b, i, ref, den, num, peak)
                    refreshed += 1
        for i in range(n):
            for j in range(dh):
                attn[i, b * dh + j] = num[b, i, j] / den[b, i]
    return rescaled, refreshed


@njit(**JIT)
def factors(s, r, marks, q, slot, p, w_o, p_all, g):
    """The factors of every window slot's projected output of a retroactive Nyström block 0
    (models/stream/model.py ``_window_out``), ring order, after ``nystrom_update``:
      p[b, slot] = s(q_b K~_b^T);   zw_b = Z_b (num_b / den_b);   g[b*m + i] = zw_b[i] W_o,b^T
      p_all[j, b*m + i] = p[b, j, i]   so that  attn_j W_o^T = p_all[j] g   (a torch product)
    p: (H, n, m) the stream's cached rows; w_o: (D, D); p_all: (n, H m); g: (H m, D)."""
    j0 = K.row(marks, r)
    den, num = s.den[r], s.num[r]
    H, m, dh = num.shape
    n, D = p.shape[1], H * dh
    zw = np.empty((m, dh), F32)
    for b in range(H):
        K.landmark_probs(q[b], marks.k_scaled_t[j0, b], p[b, slot])
        for i in range(m):                         # Z (num / den) in float64, then float32
            for e in range(dh):
                acc = 0.0
                for i2 in range(m):
                    acc += marks.z[j0, b, i, i2] * (num[b, i2, e] / den[b, i2])
                zw[i, e] = acc
        for i in range(m):                         # G_b = zw_b W_o,b^T
            for c in range(D):
                acc32 = F32(0.0)
                for e in range(dh):
                    acc32 += zw[i, e] * w_o[c, b * dh + e]
                g[b * m + i, c] = acc32
        for j in range(n):
            for i in range(m):
                p_all[j, b * m + i] = p[b, j, i]


@njit(**JIT)
def continual_fronts(tokens, rows, t, p, cfg, s, x_ring, attn, events):
    """Continual (exact) retroactive block 0 up to its attention for every stream (steady: its
    window full): embedding (into the input ring x_ring (C, n, D)), in-projection,
    ``retroactive_update``; attn (S, n, D), events (S, 4)."""
    H, n = s.k_ring.shape[1], s.k_ring.shape[2]
    D = x_ring.shape[2]
    h, qkv = np.empty(D, F32), np.empty(3 * D, F32)
    for i in range(tokens.shape[0]):
        r, ti = rows[i], t[i]
        K.embed_qkv(tokens[i], p, ti % cfg.period, h, qkv)
        x_ring[r, ti % n] = h
        q, k, v = K.heads(qkv, H)
        rescaled, refreshed = retroactive_update(s, r, q, k, v, ti, cfg, attn[i])
        events[i, 2], events[i, 3] = refreshed, rescaled


@njit(**JIT)
def nystrom_fronts(tokens, rows, t, p, cfg, s, marks, cached, x_ring, p_all, g, events):
    """Continual Nyström block 0 up to its out-projection for every stream (steady: its window
    full, no landmark change): embedding (into x_ring (C, n, D)), in-projection,
    ``nystrom_update``, ``factors`` (``cached``: the state's p (C, H, n, m)); p_all (S, n, H m),
    g (S, H m, D), events (S, 4)."""
    H, n = s.k_ring.shape[1], s.k_ring.shape[2]
    D = x_ring.shape[2]
    w_o = mat(p, param(0, OUT_W))
    h, qkv = np.empty(D, F32), np.empty(3 * D, F32)
    for i in range(tokens.shape[0]):
        r, ti = rows[i], t[i]
        K.embed_qkv(tokens[i], p, ti % cfg.period, h, qkv)
        q, k, v = K.heads(qkv, H)
        rescaled, refreshed = K.nystrom_update(s, r, marks.q_scaled[K.row(marks, r)], q, k, v, ti, cfg)
        x_ring[r, ti % n] = h
        factors(s, r, marks, q, ti % n, cached[r], w_o, p_all[i], g[i])
        events[i, 2], events[i, 3] = refreshed, rescaled


# ----------------------------------------------------------------------------- block 1
# Its products run through its input window x (n, D) with the key/value projections folded in
# (models/stream/window.py), for R query rows per head:
#   u = W_k,h^T q_hr (queries);        s = softmax(u x^T) (torch product and softmax);
#   px = s x (torch product);          mixed_hr = px W_v,h^T + b_v,h (``finish``)

@njit(**JIT)
def window_landmarks(x, seg, first, p, iters, q_scaled, k_scaled_t, z):
    """Block 1's continual landmarks over its input window x (n, D), ring order: the means of the
    aligned segments (seg: (m, 2) window ranges, oldest first; window index i is ring slot
    (first + i) % n), projected to queries and keys, folded per head into q_scaled (H, m, dh),
    k_scaled_t (H, dh, m), with their pseudo-inverse z (H, m, m) float32."""
    n, D = x.shape
    m = seg.shape[0]
    H, _, dh = q_scaled.shape
    means, qk = np.zeros((m, D), F32), np.empty((m, 2 * D), F32)
    for r in range(m):
        for i in range(seg[r, 0], seg[r, 1]):
            j = (first + i) % n
            for c in range(D):
                means[r, c] += x[j, c]
        size = F32(seg[r, 1] - seg[r, 0])
        for c in range(D):
            means[r, c] /= size
    w, b = mat(p, param(1, IN_W)), vec(p, param(1, IN_B))
    for r in range(m):
        K.linear(w[:2 * D], b[:2 * D], means[r], qk[r])
    q_land, k_land = np.empty((H, m, dh), F32), np.empty((H, m, dh), F32)
    scale = F32(1.0 / math.sqrt(dh))
    for h in range(H):
        for r in range(m):
            for e in range(dh):
                qv, kv = qk[r, h * dh + e], qk[r, D + h * dh + e]
                q_land[h, r, e], k_land[h, r, e] = qv, kv
                q_scaled[h, r, e] = qv * scale
                k_scaled_t[h, e, r] = kv * scale
    landmark_pinv_arrays(q_land, k_land, iters, np.empty((H, m, m)), z)


@njit(**JIT)
def window_landmarks_all(z, seg, first, p, iters, marks):
    """``window_landmarks`` for every stream: z (S, n, D) the windows, seg (S, m, 2), first (S,);
    ``marks`` (Landmarks, (S, ...)) written."""
    for i in range(z.shape[0]):
        window_landmarks(z[i], seg[i], first[i], p, iters, marks.q_scaled[i], marks.k_scaled_t[i], marks.z[i])


@njit(**JIT)
def queries(x, slot, p, exact, rows, q, u):
    """Block 1's query rows over its input window x (n, D): q = W_q x[slot] + b_q (D,); exact:
    rows (H, 1, dh) = q / sqrt(dh), else rows are the scaled query landmarks (H, m, dh);
    u (H*R, D) = each row folded through W_k,h."""
    D = x.shape[1]
    w, b = mat(p, param(1, IN_W)), vec(p, param(1, IN_B))
    K.linear(w[:D], b[:D], x[slot], q)
    w_k = w[D:2 * D]
    H, R, dh = rows.shape
    if exact:
        scale = F32(1.0 / math.sqrt(dh))
        for h in range(H):
            for e in range(dh):
                rows[h, 0, e] = q[h * dh + e] * scale
    for h in range(H):
        for r in range(R):
            i = h * R + r
            u[i] = 0.0
            for e in range(dh):
                qv = rows[h, r, e]
                for c in range(D):
                    u[i, c] += qv * w_k[h * dh + e, c]


@njit(**JIT)
def queries_all(z, slots, p, exact, marks, q, u):
    """``queries`` for every stream: z (S, n, D), slots (S,) the newest token's; the query rows
    ``marks.q_scaled`` (S or 1, H, R, dh); q (S, D), u (S, H R, D)."""
    for i in range(z.shape[0]):
        queries(z[i], slots[i], p, exact, marks.q_scaled[K.row(marks, i)], q[i], u[i])


@njit(**JIT)
def finish(px, p, cfg, exact, q, marks, j, x, logits):
    """Block 1's values, attention output, then its tail and the classifier:
    mixed (H, R, dh) = px W_v,h^T + b_v,h; exact: attn = mixed; Nyström: attn_h = s(q_h K~_h^T)
    Z_h mixed_h with ``marks`` row j (z float32); then logits = head(tail(x, attn)).
    px: (H*R, D); q, x: (D,)."""
    R = px.shape[0] // marks.q_scaled.shape[1]
    H, dh = marks.q_scaled.shape[1], marks.q_scaled.shape[3]
    D = px.shape[1]
    w, b = mat(p, param(1, IN_W)), vec(p, param(1, IN_B))
    w_v, b_v = w[2 * D:], b[2 * D:]
    mixed, attn = np.empty((H, R, dh), F32), np.empty(D, F32)
    for h in range(H):
        for r in range(R):
            for e in range(dh):
                acc = F32(0.0)
                for c in range(D):
                    acc += px[h * R + r, c] * w_v[h * dh + e, c]
                mixed[h, r, e] = acc + b_v[h * dh + e]
    if exact:
        for h in range(H):
            for e in range(dh):
                attn[h * dh + e] = mixed[h, 0, e]
    else:
        k1 = np.empty(R, F32)
        for h in range(H):
            K.landmark_probs(q[h * dh:(h + 1) * dh], marks.k_scaled_t[j, h], k1)
            for e in range(dh):
                attn[h * dh + e] = 0.0
            for r in range(R):
                c = F32(0.0)
                for r2 in range(R):
                    c += k1[r2] * marks.z[j, h, r2, r]
                for e in range(dh):
                    attn[h * dh + e] += c * mixed[h, r, e]
    out = np.empty(D, F32)
    K.block_tail(p, 1, cfg.eps, x, attn, out)
    K.classify(p, out, logits)


@njit(**JIT)
def finish_all(px, p, cfg, exact, q, marks, z, slots, logits):
    """``finish`` for every stream: px (S, H R, D), q (S, D), z (S, n, D) the windows, slots (S,);
    ``marks`` (S or 1, ...); logits (S, classes)."""
    for i in range(px.shape[0]):
        finish(px[i], p, cfg, exact, q[i], marks, K.row(marks, i), z[i, slots[i]], logits[i])
