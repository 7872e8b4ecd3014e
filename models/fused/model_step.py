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


def pack_parameters(tensors: list[Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Move float32 CPU ``tensors`` into one buffer: each tensor's data is rebound to its slice
    (64-byte aligned), so torch and the compiled step read and write the same memory, as with the
    views they replace. Returns (buffer (total,) float32, layout (N, 3) int64: offset, rows, cols;
    a vector has rows 1). Tensors already packed in this order keep their buffer."""
    shapes = [(t.shape[0], t.shape[1]) if t.dim() == 2 else (1, t.numel()) for t in tensors]
    offsets, total = [], 0
    for rows, cols in shapes:
        offsets.append(total)
        total += -(-rows * cols // 16) * 16
    layout = np.array([(o, r, c) for o, (r, c) in zip(offsets, shapes)], np.int64)
    base = tensors[0].untyped_storage()
    if base.nbytes() == 4 * total and all(
            t.untyped_storage().data_ptr() == base.data_ptr() and t.storage_offset() == o
            and t.is_contiguous() for t, o in zip(tensors, offsets)):
        return torch.empty(0).set_(base, 0, (total,)).numpy(), layout
    whole = torch.zeros(total)
    for t, (off, rows, cols) in zip(tensors, layout):
        view = whole[off:off + rows * cols].view(t.shape)
        view.copy_(t.detach())
        t.data = view
    return whole.numpy(), layout


def model_parameters(model) -> list[Tensor]:
    """A 1-block model's parameters in the order of kernels.EMBED_W ... HEAD_B."""
    blk = model.blocks[0]
    a = blk.attn
    return [model.embed.weight, model.embed.bias, model.pos.table, a.in_proj.weight,
            a.in_proj.bias, a.out_proj.weight, a.out_proj.bias, blk.norm1.weight,
            blk.norm1.bias, blk.ff[0].weight, blk.ff[0].bias, blk.ff[2].weight, blk.ff[2].bias,
            blk.norm2.weight, blk.norm2.bias, model.head.weight, model.head.bias]


class FusedModelStep:
    """Binds a GenreTransformer's weights (packed into one buffer, shared memory) and a step
    scratch buffer."""

    def __init__(self, model):
        if not fusable(model):
            raise ValueError("the fused step takes 1-block continual / continual_nystrom models, "
                             "float32 on the CPU")
        self.model = model
        blk = model.blocks[0]
        self.block, self.kernel = blk, blk.attn.sda
        self.w, self.layout = pack_parameters(model_parameters(model))
        self.pre, self.post = K.unpack(self.w, self.layout)
        self.eps = (float(blk.norm1.eps), float(blk.norm2.eps))
        D, F = model.cfg.d_model, model.cfg.ff_dim
        self.scratch = np.zeros(9 * D + F, np.float32)
        self.h, self.qkv, self.attn, self.bufs = K.scratch_views(self.scratch, D, F)
        self.H, self.dh = blk.attn.heads, blk.attn.d_head
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
                K.model_step_continual(x, self.w, self.layout, pos, eps1, eps2, self.scratch,
                                       ring_k, ring_v, slot, n_t, scores, out)
            else:
                slot, full, n_t, track = kernel.fused_begin()
                st = kernel.stability
                rescaled, refreshed = K.model_step_nystrom(
                    x, self.w, self.layout, pos, eps1, eps2, self.scratch, kernel.fused_arrays(),
                    slot, full, n_t, track, st.rescale, st.refresh, TAU, out)
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
