"""Compiled pieces of the 2-block step (backend.py): a retroactive block 1 over the window's n
rows, then block 2 for the newest token over block 1's outputs, keys and values folded
(models/stream/window.py). Rows are in ring order (slot of stream token t is t % n). The
``*_all`` functions take every stream of a call in one compiled call (rows: each stream's row
of the state; t: its position).

Shapes: S streams, H heads of dh, D = H dh the model width, F the feed-forward width, n the
window, m landmarks. The products over all n rows are torch's matrix products, called between
these (backend.py): torch's BLAS ran these shapes faster than numba's np.dot when measured
during development (not a `bench` row).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import kernels as K
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
            h[i, c] = max(h[i, c] + bias[c], np.float32(0.0))


# ----------------------------------------------------------------------------- block 1

@njit(**JIT)
def nystrom_front(token, pre, pos_index, h, qkv, ring_q, ring_k, ring_v, key_scores, ref, den, num, peak,
                  q_scaled, k_scaled_t, z64, seg_q, seg_k, x_ring, p, slot, full, n_t, track,
                  rescale_on, refresh_on, tau, zw, w_o, p_all, g):
    """Continual Nyström block 1 up to its out-projection, one steady token (no landmark change):
    embed (h), in-projection (qkv), running sums, token into the input ring, then the factors of
    every window slot's projected output (models/mha.py _folded_out), ring order:
      p[b, slot] = s(q_b K~_b^T);   zw_b = Z_b (num_b / den_b);   g[b*m + r] = zw_b[r] W_o,b^T
      p_all[j, b*m + r] = p[b, j, r]   so that  attn_j W_o^T = p_all[j] g   (a torch product)
    ring_* ... seg_k: the stream's state (models/stream/nystrom.NystromState); z64: (H, m, m) the
    landmarks' pseudo-inverse in float64 (it multiplies the float64 sums); x_ring: (n, D); p: (H, n, m);
    zw: (H, m, dh) buffer; w_o: (D, D) out-projection weight; p_all: (n, H m); g: (H m, D).
    Returns (any row rescaled, rows refreshed)."""
    K.embed_qkv(token, pre, pos_index, h, qkv)
    H, n, dh = ring_k.shape
    m = z64.shape[1]
    D = H * dh
    q = qkv[:D].reshape((H, dh))
    k = qkv[D:2 * D].reshape((H, dh))
    v = qkv[2 * D:].reshape((H, dh))
    flags = K.nystrom_update(q, k, v, ring_q, ring_k, ring_v, key_scores, ref, den, num, peak,
                             q_scaled, seg_q, seg_k, slot, full, n_t, track, rescale_on,
                             refresh_on, tau)
    x_ring[slot] = h
    for b in range(H):
        top = -np.inf
        for r in range(m):
            s = np.float32(0.0)
            for j in range(dh):
                s += q[b, j] * k_scaled_t[b, j, r]
            p[b, slot, r] = s
            top = max(top, s)
        total = np.float32(0.0)
        for r in range(m):
            e = np.float32(math.exp(p[b, slot, r] - top))
            p[b, slot, r] = e
            total += e
        for r in range(m):
            p[b, slot, r] /= total
        for r in range(m):                         # Z (num / den) in float64, then float32
            for e in range(dh):
                acc = 0.0
                for s_ in range(m):
                    acc += z64[b, r, s_] * (num[b, s_, e] / den[b, s_])
                zw[b, r, e] = acc
        for r in range(m):                         # G_b = zw_b W_o,b^T
            for c in range(D):
                acc32 = np.float32(0.0)
                for e in range(dh):
                    acc32 += zw[b, r, e] * w_o[c, b * dh + e]
                g[b * m + r, c] = acc32
        for j in range(n_t):
            for r in range(m):
                p_all[j, b * m + r] = p[b, j, r]
    return flags


# ----------------------------------------------------------------------------- block 2

@njit(**JIT)
def window_landmarks(x, seg, first, w_qk, b_qk, iters, means, qk, q_land, k_land, q_scaled,
                     k_scaled_t, z64, z32):
    """Block 2's continual landmarks over its input window x (n, D), ring order: the means of the
    aligned segments (seg: (m, 2) window ranges, oldest first; window index i is ring slot
    (first + i) % n), projected to queries and keys (w_qk: (2D, D), b_qk: (2D,)), folded per head
    into q_land, k_land, q_scaled: (H, m, dh) and k_scaled_t: (H, dh, m), with their
    pseudo-inverse z64, z32: (H, m, m). means: (m, D), qk: (m, 2D) buffers."""
    n, D = x.shape
    m = seg.shape[0]
    for r in range(m):
        means[r] = 0.0
        for i in range(seg[r, 0], seg[r, 1]):
            j = (first + i) % n
            for c in range(D):
                means[r, c] += x[j, c]
        size = np.float32(seg[r, 1] - seg[r, 0])
        for c in range(D):
            means[r, c] /= size
    for r in range(m):
        K.linear(w_qk, b_qk, means[r], qk[r])
    H, _, dh = q_land.shape
    s = np.float32(1.0 / math.sqrt(dh))
    for h in range(H):
        for r in range(m):
            for e in range(dh):
                qv, kv = qk[r, h * dh + e], qk[r, D + h * dh + e]
                q_land[h, r, e], k_land[h, r, e] = qv, kv
                q_scaled[h, r, e] = qv * s
                k_scaled_t[h, e, r] = kv * s
    landmark_pinv_arrays(q_land, k_land, iters, z64, z32)


@njit(**JIT)
def continual_front(token, pre, pos_index, h, qkv, ring_q, ring_k, ring_v, ref, den, num, peak,
                    scores, x_ring, slot, full, rescale_on, refresh_on, tau, attn):
    """Continual (exact) retroactive block 1 up to its attention, one token after the first, window
    full after it: embed (h), in-projection (qkv), token into the input ring, then per head the
    running sums of every query slot (models/stream/sums.py): the departing key leaves every
    row, the new key joins every row (rescaling a row whose reference rises), the newest query's
    row is computed from scratch, stale rows are refreshed from cached scores; attn[j, head] =
    num_j / den_j, ring order. ring_*: (H, n, dh); ref, den, peak: (H, n); num: (H, n, dh);
    scores: (H, n, n) cached scaled score of query slot i against key slot j (the state's
    key-major scores, transposed); x_ring, attn: (n, D). Returns (any row rescaled, rows refreshed)."""
    K.embed_qkv(token, pre, pos_index, h, qkv)
    H, n, dh = ring_k.shape
    D = H * dh
    q = qkv[:D].reshape((H, dh))
    k = qkv[D:2 * D].reshape((H, dh))
    v = qkv[2 * D:].reshape((H, dh))
    x_ring[slot] = h
    scale = np.float32(1.0 / math.sqrt(dh))
    rescaled, refreshed = False, 0
    for b in range(H):
        for j in range(dh):
            ring_q[b, slot, j] = q[b, j]
            ring_k[b, slot, j] = k[b, j]
        for r in range(n):             # every row: the departing key (cached score) out, new in
            s = np.float32(0.0)
            for j in range(dh):
                s += ring_q[b, r, j] * k[b, j]
            s *= scale
            if K.swap_term(b, r, scores[b, r, slot], ring_v[b, slot], full, s, v[b], ref, den,
                           num, peak, rescale_on):
                rescaled = True
            scores[b, r, slot] = s
        for j in range(dh):
            ring_v[b, slot, j] = v[b, j]
        for t in range(n):             # the newest query's row, from scratch
            s = np.float32(0.0)
            for j in range(dh):
                s += ring_k[b, t, j] * q[b, j]
            scores[b, slot, t] = s * scale
        _fresh_row32(scores[b, slot], ring_v[b], b, slot, ref, den, num, peak)
        if refresh_on:
            for r in range(n):
                if den[b, r] < tau * peak[b, r]:
                    _fresh_row32(scores[b, r], ring_v[b], b, r, ref, den, num, peak)
                    refreshed += 1
        for r in range(n):
            for j in range(dh):
                attn[r, b * dh + j] = num[b, r, j] / den[b, r]
    return rescaled, refreshed


@njit(**JIT)
def _fresh_row32(row_scores, values, b, r, ref, den, num, peak):
    """Row r of head b from scratch (float32): row_scores: (n,), values: (n, dh)."""
    top = row_scores.max()
    num[b, r] = 0.0
    total = np.float32(0.0)
    for t in range(row_scores.shape[0]):
        e = np.float32(math.exp(row_scores[t] - top))
        total += e
        for j in range(values.shape[1]):
            num[b, r, j] += e * values[t, j]
    ref[b, r], den[b, r], peak[b, r] = top, total, total


# Block 2's products run through its input window x (n, D) with the key/value projections folded
# in (models/sda/window.FoldedKeyValues), for R query rows per head (m landmarks, or 1 query):
#   u = W_k,h^T q_hr (queries);        s = softmax(u x^T) (torch product and softmax);
#   px = s x (torch product);          mixed_hr = px W_v,h^T + b_v,h (unfold_values)

@njit(**JIT)
def queries(z, slot, w_q, b_q, w_k, exact, rows, q, u):
    """Block 2's query rows over its input window z (n, D): q = W_q z[slot] + b_q (D,); exact:
    rows (H, 1, dh) = q / sqrt(dh), else rows are the scaled query landmarks (H, m, dh);
    u (H*R, D) = each row folded through W_k,h."""
    K.linear(w_q, b_q, z[slot], q)
    H, R, dh = rows.shape
    D = z.shape[1]
    if exact:
        scale = np.float32(1.0 / math.sqrt(dh))
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
def finish(px, w_v, b_v, mixed, exact, q, k_scaled_t, z, attn, x, post, eps1, eps2, bufs, logits):
    """Block 2's values, attention output, then its tail and the classifier:
    mixed (H, R, dh) = px W_v,h^T + b_v,h; exact: attn = mixed; Nyström: attn_h = s(q_h K~_h^T)
    Z_h mixed_h with k_scaled_t (H, dh, m), z (H, m, m); then logits = head(tail(x, attn)).
    px: (H*R, D); q, attn, x: (D,); post, bufs: as kernels.tail_and_head."""
    H, R, dh = mixed.shape
    D = px.shape[1]
    for h in range(H):
        for r in range(R):
            for e in range(dh):
                acc = np.float32(0.0)
                for c in range(D):
                    acc += px[h * R + r, c] * w_v[h * dh + e, c]
                mixed[h, r, e] = acc + b_v[h * dh + e]
    if exact:
        for h in range(H):
            for e in range(dh):
                attn[h * dh + e] = mixed[h, 0, e]
    else:
        k1 = np.empty(R, np.float32)
        for h in range(H):
            top = -np.inf
            for r in range(R):
                acc = np.float32(0.0)
                for e in range(dh):
                    acc += q[h * dh + e] * k_scaled_t[h, e, r]
                k1[r] = acc
                top = max(top, acc)
            total = np.float32(0.0)
            for r in range(R):
                k1[r] = np.float32(math.exp(k1[r] - top))
                total += k1[r]
            for e in range(dh):
                attn[h * dh + e] = 0.0
            for r in range(R):
                c = np.float32(0.0)
                for r2 in range(R):
                    c += (k1[r2] / total) * z[h, r2, r]
                for e in range(dh):
                    attn[h * dh + e] += c * mixed[h, r, e]
    K.tail_and_head(x, attn, post, eps1, eps2, bufs, logits)


# ----------------------------------------------------------------------------- every stream of a call

@njit(**JIT)
def continual_fronts(tokens, rows, t, pre, period, h, qkv, q_ring, k_ring, v_ring, key_scores, ref, den, num,
                     peak, x_ring, rescale_on, refresh_on, tau, attn, events):
    """``continual_front`` for every stream (steady: its window full): attn (S, n, D), events (S, 4)."""
    n = q_ring.shape[2]
    for i in range(tokens.shape[0]):
        r, ti = rows[i], t[i]
        rescaled, refreshed = continual_front(
            tokens[i], pre, ti % period, h, qkv, q_ring[r], k_ring[r], v_ring[r], ref[r], den[r], num[r], peak[r],
            key_scores[r].transpose((0, 2, 1)), x_ring[r], ti % n, True, rescale_on, refresh_on, tau, attn[i])
        events[i, 2], events[i, 3] = refreshed, rescaled


@njit(**JIT)
def nystrom_fronts(tokens, rows, t, pre, period, h, qkv, ring_q, ring_k, ring_v, key_scores, ref, den, num, peak,
                   q_scaled, k_scaled_t, z64, shared, seg_q, seg_k, seg_count, x_ring, p, track, rescale_on,
                   refresh_on, tau, zw, w_o, p_all, g, events):
    """``nystrom_front`` for every stream (steady: its window full, no landmark change); the
    landmarks one set for all where ``shared`` (fixed), else each stream's row; p_all (S, n, H m),
    g (S, H m, D); events (S, 4)."""
    n = ring_q.shape[2]
    for i in range(tokens.shape[0]):
        r, ti = rows[i], t[i]
        marks = 0 if shared else r
        rescaled, refreshed = nystrom_front(
            tokens[i], pre, ti % period, h, qkv, ring_q[r], ring_k[r], ring_v[r], key_scores[r], ref[r], den[r],
            num[r], peak[r], q_scaled[marks], k_scaled_t[marks], z64[marks], seg_q[r], seg_k[r], x_ring[r], p[r],
            ti % n, True, n, track, rescale_on, refresh_on, tau, zw, w_o, p_all[i], g[i])
        if track:
            seg_count[r] += 1
        events[i, 2], events[i, 3] = refreshed, rescaled


@njit(**JIT)
def window_landmarks_all(z, seg, first, w_qk, b_qk, iters, means, qk, q_land, k_land, q_scaled, k_scaled_t,
                         z64, z32):
    """``window_landmarks`` for every stream: z (S, n, D), seg (S, m, 2), first (S,); the
    landmarks (S, H, m, dh), (S, H, dh, m) and pseudo-inverses (S, H, m, m)."""
    for i in range(z.shape[0]):
        window_landmarks(z[i], seg[i], first[i], w_qk, b_qk, iters, means, qk, q_land[i], k_land[i],
                         q_scaled[i], k_scaled_t[i], z64[i], z32[i])


@njit(**JIT)
def queries_all(z, slots, w_q, b_q, w_k, exact, rows, shared, q, u):
    """``queries`` for every stream: z (S, n, D), slots (S,) the newest token's; rows (S or 1,
    H, R, dh) (one set for all where ``shared``); q (S, D), u (S, H R, D)."""
    for i in range(z.shape[0]):
        queries(z[i], slots[i], w_q, b_q, w_k, exact, rows[0 if shared else i], q[i], u[i])


@njit(**JIT)
def finish_all(px, w_v, b_v, mixed, exact, q, k_scaled_t, zl, shared, attn, z, slots, post, eps1, eps2, bufs,
               logits):
    """``finish`` for every stream: px (S, H R, D), q (S, D), landmarks (S or 1, ...), z (S, n, D);
    logits (S, classes)."""
    for i in range(px.shape[0]):
        j = 0 if shared else i
        finish(px[i], w_v, b_v, mixed, exact, q[i], k_scaled_t[j], zl[j], attn, z[i, slots[i]], post, eps1, eps2,
               bufs, logits[i])
