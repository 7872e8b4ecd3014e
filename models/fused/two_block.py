"""The fused 2-block step: a retroactive block 1, then a single-output block 2 fed by block 1's
window (Hedegaard et al.), continual or continual Nyström, batch 1, float32 on the CPU, a few
compiled calls per token (models/fused/blocks.py):

  block 1   embedding, in-projection, the attention's running sums, the outputs of all n window
            slots (Nyström: left factored, W_o folded into the landmark rows, models/mha.py),
            then out-projection, norms and feed-forward over the n rows (BLAS products)
  block 2   the newest row's query over the window, keys and values never formed (folded);
            continual landmarks: the aligned segment means of the current window, projected, and
            their pseudo-inverse, every step; then out-projection, tail and classifier

The window stays in ring order: every operation is per row or a sum over keys, so order does not
matter, and the continual landmarks' segments are mapped to ring slots. The steps before the
window is full, those that change block 1's landmarks (a new continual landmark, a rebuild after
a switch) and block 2's first with fixed landmarks run the torch reference on the same state.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..landmarks import aligned_segments
from ..running_sums import TAU
from ..sda.continual_nystrom import Landmarks
from ..sda.kernel import StepReport
from . import blocks as B


def fusable_two_block(model) -> bool:
    """A 2-block continual or continual Nyström GenreTransformer, float32 on the CPU."""
    cfg, p = model.cfg, model.embed.weight
    return (cfg.variant in ("continual", "continual_nystrom") and cfg.layers == 2
            and p.device.type == "cpu" and p.dtype == torch.float32)


class FusedTwoBlockStep:
    """Binds a 2-block model's weights (numpy views, shared memory) and step buffers; ``step`` takes
    a token in the compiled calls, or in the torch reference (``steady`` says which)."""

    def __init__(self, model):
        if not fusable_two_block(model):
            raise ValueError("the fused 2-block step takes 2-block continual / continual_nystrom "
                             "models, float32 on the CPU")
        cfg = model.cfg
        self.model, self.n, self.m = model, cfg.window, cfg.num_landmarks
        self.exact = cfg.variant == "continual"
        b1, b2 = model.blocks
        self.block1, self.k1, self.k2 = b1, b1.attn.sda, b2.attn.sda
        P = lambda t: t.detach().numpy()  # noqa: E731
        self.pre = (P(model.embed.weight), P(model.embed.bias), P(model.pos.table),
                    P(b1.attn.in_proj.weight), P(b1.attn.in_proj.bias))
        self.post2 = (P(b2.attn.out_proj.weight), P(b2.attn.out_proj.bias), P(b2.norm1.weight),
                      P(b2.norm1.bias), P(b2.ff[0].weight), P(b2.ff[0].bias), P(b2.ff[2].weight),
                      P(b2.ff[2].bias), P(b2.norm2.weight), P(b2.norm2.bias),
                      P(model.head.weight), P(model.head.bias))
        self.eps2 = (float(b2.norm1.eps), float(b2.norm2.eps))
        D, F, H, n = cfg.d_model, cfg.ff_dim, cfg.heads, cfg.window
        R, dh = (1 if self.exact else cfg.num_landmarks), D // H   # block 2's query rows per head
        w, bias = P(b2.attn.in_proj.weight), P(b2.attn.in_proj.bias)
        self.w_q, self.b_q, self.w_k = w[:D], bias[:D], w[D:2 * D]
        self.w_v, self.b_v = w[2 * D:], bias[2 * D:]
        self.w_qk, self.b_qk = w[:2 * D], bias[:2 * D]
        # block 1's n-row products run in torch on transposed weight views; each norm's arguments:
        # (bias of the product before it, norm weight, norm bias, eps)
        W = lambda lin: lin.weight.detach().t()  # noqa: E731
        self.out1, self.ff1, self.ff2 = W(b1.attn.out_proj), W(b1.ff[0]), W(b1.ff[2])
        self.norm1 = (P(b1.attn.out_proj.bias), P(b1.norm1.weight), P(b1.norm1.bias),
                      float(b1.norm1.eps))
        self.norm2 = (P(b1.ff[2].bias), P(b1.norm2.weight), P(b1.norm2.bias), float(b1.norm2.eps))
        self.b_ff1 = P(b1.ff[0].bias)
        f32 = lambda *shape: torch.empty(shape)  # noqa: E731
        m1 = 1 if self.exact else cfg.num_landmarks     # block 1's factored output (Nyström)
        self.T = dict(attn=f32(n, D), a=f32(n, D), y=f32(n, D), hid=f32(n, F), f=f32(n, D),
                      z=f32(n, D), u=f32(H * R, D), s=f32(H * R, n), p=f32(H * R, n),
                      px=f32(H * R, D), p_all=f32(n, H * m1), g=f32(H * m1, D))
        self.w_o1 = P(b1.attn.out_proj.weight)
        self.A = {k: v.numpy() for k, v in self.T.items()}          # the same memory
        f32 = lambda *shape: np.empty(shape, np.float32)  # noqa: E731
        self.h, self.qkv, self.zw = f32(D), f32(3 * D), f32(H, R, dh)
        self.q2, self.qs, self.mixed, self.attn2 = f32(D), f32(H, 1, dh), f32(H, R, dh), f32(D)
        self.means, self.qk = f32(R, D), f32(R, 2 * D)
        self.bufs = (f32(D), f32(D), f32(F), f32(D), f32(D))
        self.no_marks = (f32(H, dh, 1), f32(H, 1, 1))          # exact: unused landmark arguments
        self.iters, self.period = cfg.pinv_iters, cfg.period
        self.token_shape, self.classes = (1, cfg.in_dim), cfg.num_classes
        self._segments: dict[int, np.ndarray] = {}
        self._reports = (StepReport(n_t=n), StepReport(n_t=n, event="window"))   # block 2's, shared
        self._views: dict[str, tuple] = {}
        if not self.exact:          # block 2's continual landmarks, rewritten in place every step
            t = lambda *s, dtype=torch.float32: torch.empty(s, dtype=dtype)  # noqa: E731
            m, f64 = R, torch.float64
            self.marks2 = Landmarks(t(H, m, dh), t(H, m, dh), t(H, m, dh), t(H, dh, m),
                                    t(H, m, m), t(H, m, m, dtype=f64), t(H, 1, m), t(H, 1, m),
                                    t(H, 1, m, dtype=f64), t(H, 1, m, dtype=f64))
            mk = self.marks2
            self.marks2_arrays = tuple(x.numpy() for x in (mk.q, mk.k, mk.q_scaled, mk.k_scaled_t,
                                                           mk.z64, mk.z))

    def steady(self) -> bool:
        """Whether the compiled calls take the next token: the window is full, block 1's landmarks
        do not change and block 2 has its landmarks (or takes continual ones)."""
        k1, k2, st = self.k1, self.k2, self.k1.st
        if st is None or st.t < self.n or st.rows is None or self.block1._x is None:
            return False
        if not self.exact:
            if st.p is None or st.rows.sums.num.dtype != torch.float64:
                return False
            if k1.mode != "fixed" and k1.tracker.completes_next():
                return False
        st2 = k2.st
        return (st2 is not None and st2.d > 0
                and (self.exact or k2.mode == "continual" or st2.marks is not None))

    def step(self, token: Tensor, t: int) -> Tensor:
        """token: (1, in_dim), the stream's t-th token (0-based) -> logits (1, classes)."""
        if not self.steady():
            return self.model._continual_step(token, t)
        blk, n, T, A = self.block1, self.n, self.T, self.A
        x_ring = self._view("x", blk._x)[0]
        blk.__dict__["_t"] = blk._t + 1
        slot = self._block1(token.numpy()[0], t % self.period, x_ring)
        # block 1's tail over the n rows: y = LN1(x + attn W_o^T + b_o), z = LN2(y + FF(y)),
        # Nyström: attn W_o^T = p_all g (W_o folded into the landmark rows)
        if self.exact:
            torch.mm(T["attn"], self.out1, out=T["a"])
        else:
            torch.mm(T["p_all"], T["g"], out=T["a"])
        B.norm_rows(x_ring, A["a"], *self.norm1, A["y"])
        torch.mm(T["y"], self.ff1, out=T["hid"])
        B.bias_relu(A["hid"], self.b_ff1)
        torch.mm(T["hid"], self.ff2, out=T["f"])
        z = A["z"]
        B.norm_rows(A["y"], A["f"], *self.norm2, z)
        # block 2: the newest row over the window, keys and values folded in
        st2 = self.k2.st
        st2.t += 1
        if self.exact:
            rows, (k_scaled_t, z_land) = self.qs, self.no_marks
            self.k2.report = self._reports[0]
        else:
            if self.k2.mode == "continual":
                B.window_landmarks(z, self._segments_of(st2.t), st2.t % n, self.w_qk, self.b_qk,
                                   self.iters, self.means, self.qk, *self.marks2_arrays)
                st2.marks = self.marks2
                self.k2.report = self._reports[1]
            else:
                self.k2.report = self._reports[0]
            mk = st2.marks
            rows, k_scaled_t, z_land = (self._view("q2", mk.q_scaled),
                                        self._view("k2", mk.k_scaled_t), self._view("z2", mk.z))
        B.queries(z, slot, self.w_q, self.b_q, self.w_k, self.exact, rows, self.q2, A["u"])
        torch.mm(T["u"], T["z"].t(), out=T["s"])
        torch.softmax(T["s"], dim=-1, out=T["p"])          # torch's exp is vectorised, numba's not
        torch.mm(T["p"], T["z"], out=T["px"])
        logits = np.empty((1, self.classes), np.float32)
        B.finish(A["px"], self.w_v, self.b_v, self.mixed, self.exact, self.q2, k_scaled_t, z_land,
                 self.attn2, z[slot], self.post2, *self.eps2, self.bufs, logits[0])
        return torch.from_numpy(logits)

    def _block1(self, x: np.ndarray, pos: int, x_ring: np.ndarray) -> int:
        """Block 1's attention for token x (in_dim,) at position index ``pos``: the kernel's state
        updated as its torch step would; continual: the outputs attn (n, D), Nyström: their
        factors p_all, g; ring order. Returns the token's slot."""
        k1, n, A = self.k1, self.n, self.A
        st, stab = k1.st, k1.stability
        if self.exact:
            slot = st.t % n
            st.t += 1
            rows, ring = st.rows, st.ring
            flags = B.continual_front(
                x, self.pre, pos, self.h, self.qkv, *self._views_of(
                    "ring", (ring.q, ring.k, ring.v, rows.ref, rows.den, rows.num, rows.peak,
                             st.scores)),
                x_ring, slot, True, stab.rescale, stab.refresh, TAU, A["attn"])
            k1.report = StepReport(n_t=n, evicted=True, rescaled=bool(flags[0]),
                                   rows_refreshed=int(flags[1]))
            return slot
        slot, full, n_t, track = k1.fused_begin()
        flags = B.nystrom_front(x, self.pre, pos, self.h, self.qkv, k1.fused_arrays(),
                                self._view("z64", st.marks.z64), x_ring, self._view("p", st.p),
                                slot, full, n_t, track, stab.rescale, stab.refresh, TAU, self.zw,
                                self.w_o1, A["p_all"], A["g"])
        k1.fused_end(*flags)
        return slot

    def _segments_of(self, tokens: int) -> np.ndarray:
        """Block 2's aligned segments after ``tokens`` (>= n) tokens as (m, 2) window ranges; they
        repeat with period n."""
        seg = self._segments.get(tokens % self.n)
        if seg is None:
            seg = self._segments[tokens % self.n] = np.array(
                aligned_segments(tokens, self.n, self.m), np.int64)
        return seg

    def _view(self, role: str, x: Tensor) -> np.ndarray:
        """x.numpy(), cached while ``role`` is played by the same tensor."""
        hit = self._views.get(role)
        if hit is None or hit[0] is not x:
            hit = self._views[role] = (x, x.numpy())
        return hit[1]

    def _views_of(self, role: str, xs: tuple) -> tuple:
        """``_view`` for a tuple of tensors."""
        hit = self._views.get(role)
        if hit is None or len(hit[0]) != len(xs) or any(a is not b for a, b in zip(hit[0], xs)):
            hit = self._views[role] = (xs, tuple(x.numpy() for x in xs))
        return hit[1]
