"""The fused model step: a 1-block continual or continual Nyström GenreTransformer, batch 1,
float32 on the CPU, one compiled call per token (embedding, in-projection, attention over every
head, out-projection, norms, feed-forward, classifier).

Steps that change landmarks (the first, warm-up, a new continual landmark) run the attention in
the torch kernel on the same state, between a compiled front half (embedding, in-projection) and
back half (the rest); the kernel's report and FLOPs are the same either way.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..running_sums import TAU
from . import kernels as K


def fusable(model) -> bool:
    """Whether ``model`` (a GenreTransformer) can take fused steps."""
    cfg, p = model.cfg, model.embed.weight
    return (cfg.variant in ("continual", "continual_nystrom") and cfg.layers == 1
            and p.device.type == "cpu" and p.dtype == torch.float32)


def fused_model_step(model):
    """The fused whole-model step for ``model`` (1 block: FusedModelStep; 2 blocks, continual or
    continual Nyström: two_block.FusedTwoBlockStep), or None where the model takes none."""
    from .two_block import FusedTwoBlockStep, fusable_two_block
    if fusable(model):
        return FusedModelStep(model)
    return FusedTwoBlockStep(model) if fusable_two_block(model) else None


class FusedModelStep:
    """Binds a GenreTransformer's weights (numpy views, shared memory) and step buffers."""

    def __init__(self, model):
        if not fusable(model):
            raise ValueError("the fused step takes 1-block continual / continual_nystrom models, "
                             "float32 on the CPU")
        self.model = model
        blk = model.blocks[0]
        self.block, self.kernel = blk, blk.attn.sda
        P = lambda t: t.detach().numpy()  # noqa: E731
        a = blk.attn
        self.pre = (P(model.embed.weight), P(model.embed.bias), P(model.pos.table),
                    P(a.in_proj.weight), P(a.in_proj.bias))
        self.post = (P(a.out_proj.weight), P(a.out_proj.bias), P(blk.norm1.weight), P(blk.norm1.bias),
                     P(blk.ff[0].weight), P(blk.ff[0].bias), P(blk.ff[2].weight), P(blk.ff[2].bias),
                     P(blk.norm2.weight), P(blk.norm2.bias), P(model.head.weight), P(model.head.bias))
        self.eps = (float(blk.norm1.eps), float(blk.norm2.eps))
        D, F = model.cfg.d_model, model.cfg.ff_dim
        self.h, self.qkv, self.attn = (np.empty(D, np.float32), np.empty(3 * D, np.float32),
                                       np.empty(D, np.float32))
        self.bufs = (np.empty(D, np.float32), np.empty(D, np.float32), np.empty(F, np.float32),
                     np.empty(D, np.float32), np.empty(D, np.float32))
        self.H, self.dh = a.heads, a.d_head
        self.period = model.cfg.period
        self.token_shape = (1, model.cfg.in_dim)
        self.exact = model.cfg.variant == "continual"
        self.classes = model.cfg.num_classes

    def step(self, token: Tensor, t: int) -> Tensor:
        """token: (1, in_dim), the stream's t-th token (0-based) -> logits (1, classes)."""
        x = token.numpy()[0]
        logits = np.empty((1, self.classes), np.float32)
        out = logits[0]
        pos, kernel = t % self.period, self.kernel
        if kernel.steady_next():
            eps1, eps2 = self.eps
            if self.exact:
                slot, n_t = kernel.fused_begin()
                ring_k, ring_v, scores = kernel.fused_arrays()
                K.model_step_continual(x, self.pre, pos, self.post, eps1, eps2, self.h, self.qkv,
                                       self.attn, self.bufs, ring_k, ring_v, slot, n_t, scores, out)
            else:
                slot, full, n_t, track = kernel.fused_begin()
                st = kernel.stability
                rescaled, refreshed = K.model_step_nystrom(
                    x, self.pre, pos, self.post, eps1, eps2, self.h, self.qkv, self.attn, self.bufs,
                    kernel.fused_arrays(), slot, full, n_t, track, st.rescale, st.refresh, TAU, out)
                kernel.fused_end(rescaled, refreshed)
            return torch.from_numpy(logits)
        # a step that changes landmarks: the torch kernel between the two compiled halves
        K.embed_qkv(x, self.pre, pos, self.h, self.qkv)
        D = self.H * self.dh
        qkv = torch.from_numpy(self.qkv)
        q, k, v = (qkv[i * D:(i + 1) * D].view(self.H, self.dh) for i in range(3))
        self.attn[:] = kernel.step(q, k, v).reshape(D).numpy()
        K.tail_and_head(self.h, self.attn, self.post, *self.eps, self.bufs, out)
        return torch.from_numpy(logits)
