"""Multi-head attention for every variant over a window (the batch forward: training, the
recomputing variants at run time, and the reference every streaming step is tested against);
its weights, landmark mode and fixed landmarks are what the streaming step (models/stream/) reads.

Weights follow ``torch.nn.MultiheadAttention`` (packed in-projection, out-projection), so a trained
torch module can be converted with ``MultiheadAttention.from_torch``. Heads are folded into the
batch before the SDA: (B, T, d_model) -> (B * heads, T, d_head), head index fastest.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .landmarks import check_landmarks, segment_means
from .sda import LANDMARK_MODES, VARIANTS, attention, nystrom_attention


def _forget_fitted(module, incompatible_keys) -> None:
    """After a state dict is loaded, ``has_fixed`` is read again when next asked."""
    module._fitted = None


class MultiheadAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, window: int, variant: str, *,
                 num_landmarks: int | None = None, landmark_mode: str | None = None, pinv_iters: int = 6):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        nystrom = variant in ("nystrom", "continual_nystrom")
        self.d_model, self.heads, self.d_head = d_model, heads, d_model // heads
        self.window, self.variant, self.pinv_iters = window, variant, pinv_iters
        self.num_landmarks = num_landmarks if nystrom else None
        if nystrom:
            check_landmarks(window, num_landmarks)
        self.landmark_mode = (landmark_mode or LANDMARK_MODES[variant][0]) if nystrom else None
        self.compiled_pinv = False     # batch forward: models/fused/pinv.py in inference (CPU f32)
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        m = num_landmarks if nystrom else 0
        # fixed landmarks per head (H, m, d_head); all zeros until fitted (has_fixed = 0)
        self.register_buffer("fixed_q_land", torch.zeros(heads, m, self.d_head))
        self.register_buffer("fixed_k_land", torch.zeros(heads, m, self.d_head))
        self.register_buffer("has_fixed", torch.zeros((), dtype=torch.bool))
        self._fitted: bool | None = None                 # has_fixed read once (a forward never waits on it)
        self.register_load_state_dict_post_hook(_forget_fitted)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, window: int, variant: str, **kw) -> "MultiheadAttention":
        """Copy the weights of a ``torch.nn.MultiheadAttention`` (packed projections, with bias)."""
        if not mha._qkv_same_embed_dim or mha.in_proj_bias is None:
            raise ValueError("from_torch needs a MultiheadAttention with equal q/k/v dims and bias")
        ours = cls(mha.embed_dim, mha.num_heads, window, variant, **kw)
        with torch.no_grad():
            ours.in_proj.weight.copy_(mha.in_proj_weight)
            ours.in_proj.bias.copy_(mha.in_proj_bias)
            ours.out_proj.weight.copy_(mha.out_proj.weight)
            ours.out_proj.bias.copy_(mha.out_proj.bias)
        return ours.to(mha.in_proj_weight.device)

    # ------------------------------------------------------------------ landmarks
    def set_fixed_landmarks(self, q_land: Tensor, k_land: Tensor) -> None:
        """Install fixed landmarks (heads, m, d_head) and switch to landmark mode 'fixed'."""
        want = (self.heads, self.num_landmarks, self.d_head)
        if self.num_landmarks is None or tuple(q_land.shape) != want or tuple(k_land.shape) != want:
            raise ValueError(f"fixed landmarks must have shape {want}, got "
                             f"{tuple(q_land.shape)} and {tuple(k_land.shape)}")
        with torch.no_grad():
            self.fixed_q_land.copy_(q_land)
            self.fixed_k_land.copy_(k_land)
            self.has_fixed.fill_(True)
        self._fitted = True
        self.set_landmark_mode("fixed")

    @property
    def fixed_fitted(self) -> bool:
        """Whether fixed landmarks are fitted: the buffer ``has_fixed`` read once after a fit
        or a load, so that no forward waits for the device to tell."""
        if self._fitted is None:
            self._fitted = bool(self.has_fixed)
        return self._fitted

    def set_landmark_mode(self, mode: str) -> None:
        """Switch landmark mode ('fixed' needs fitted landmarks); a streaming model switches its
        streams' state too (GenreTransformer.set_landmark_mode)."""
        if self.num_landmarks is None:
            raise ValueError(f"variant {self.variant!r} has no landmarks")
        if mode == "fixed" and not self.fixed_fitted:
            raise ValueError("landmark_mode 'fixed' needs fitted landmarks: run "
                             "models.landmarks.fit_fixed_landmarks(model, sequences) first")
        if mode not in LANDMARK_MODES[self.variant]:
            raise ValueError(f"unknown landmark mode {mode!r} for {self.variant!r}; "
                             f"valid: {LANDMARK_MODES[self.variant]}")
        self.landmark_mode = mode

    def _fold(self, x: Tensor) -> Tensor:
        """(B, T, d_model) -> (B * heads, T, d_head)."""
        B, T, _ = x.shape
        return x.reshape(B, T, self.heads, self.d_head).transpose(1, 2).reshape(B * self.heads, T, self.d_head)

    def _unfold(self, x: Tensor, B: int) -> Tensor:
        """(B * heads, T, d_head) -> (B, T, d_model)."""
        T = x.shape[1]
        return x.reshape(B, self.heads, T, self.d_head).transpose(1, 2).reshape(B, T, self.d_model)

    def default_landmarks(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Batch landmarks for folded q, k (B*H, T, d_head): fixed ones, or segment means."""
        if self.landmark_mode == "fixed":
            if not self.fixed_fitted:
                raise ValueError("this model's fixed landmarks are not fitted: load them from a "
                                 "checkpoint or run models.landmarks.fit_fixed_landmarks first")
            reps = q.shape[0] // self.heads
            return self.fixed_q_land.repeat(reps, 1, 1), self.fixed_k_land.repeat(reps, 1, 1)
        mm = min(self.num_landmarks, q.shape[1])
        return segment_means(q, mm), segment_means(k, mm)

    # ------------------------------------------------------------------ batch
    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: (B, T, d_model) -> folded q, k, v: (B * heads, T, d_head)."""
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        return self._fold(q), self._fold(k), self._fold(v)

    def forward(self, x: Tensor, landmarks: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Attention of every token of a window. x: (B, T, d_model) -> (B, T, d_model).

        landmarks: optional folded (B * heads, m', d_head) pair (e.g. a stream's ``landmarks()``).
        """
        B = x.shape[0]
        q, k, v = self.qkv(x)
        if self.num_landmarks is None:
            out = attention(q, k, v)
        else:
            ql, kl = landmarks if landmarks is not None else self.default_landmarks(q, k)
            z = None
            if (self.compiled_pinv and not torch.is_grad_enabled() and ql.dtype == torch.float32
                    and ql.device.type == "cpu"):
                from .fused.pinv import landmark_pinv as compiled
                z = compiled(ql, kl, self.pinv_iters)[0]
            out = nystrom_attention(q, k, v, ql, kl, self.pinv_iters, z=z)
        return self.out_proj(self._unfold(out, B))
