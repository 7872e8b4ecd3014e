"""musicnn (Pons & Serra, 2019) in torch: the MSD- or MTT-trained music tagger whose weights ship
with the PyPI package ``musicnn`` 0.1.0, read without TensorFlow.

Input: a patch of 187 log-mel frames x 96 bands (audio/musicnn/mel.py). Network, as the
package's ``models.py`` defines it (TF layout: time is the height axis):

  input batch norm (one scalar pair)
  timbral:  conv 7x38 and 7x67 (204 ch each, time zero-padded by 3, valid in frequency)
  temporal: conv 128x1, 64x1, 32x1 (51 ch each, 'same' padding in time)
            each conv -> ReLU -> batch norm -> max over frequency      -> (T, 561)
  mid-end:  conv 7x561 -> 64, then two 7x64 -> 64 with residuals (each conv -> ReLU -> BN)
  back-end: max and mean over time of the 753-ch concatenation (interleaved max, mean),
            BN -> dense 1506 -> 200, ReLU -> BN -> dense 200 -> 50 -> sigmoid = taggram (50,)

Weights: ``assets/musicnn/MSD_musicnn.safetensors``, converted once from the package's TF 1
checkpoint by scripts/convert_musicnn.py (the inference tensors only), shipped with its ISC
licence beside it, read with the safetensors library; the tensors' sha256 is checked at every load.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..assets import assets_dir
from ..errors import MusicnnWeightsError
from ..frontend_names import PRECISIONS

WEIGHTS_DIR = assets_dir() / "musicnn"
MODELS = ("MSD_musicnn",)
PATCH_FRAMES = 187
BANDS = 96
TAGS = 50
TIMBRAL = (38, 67)            # kernel widths in frequency (0.4 and 0.7 of 96 bands)
TIMBRAL_CH = 204
TIMBRAL_COLS = 208            # the continual front ends' timbral product: 204 filters, 4 of zeros
                              # (audio/musicnn/branches.py timbral_branches says why)
TEMPORAL = (128, 64, 32)      # kernel lengths in time
TEMPORAL_CH = 51
FRONT_CH = 2 * TIMBRAL_CH + 3 * TEMPORAL_CH      # 561
MID_CH = 64
BN_EPS = 1e-3                 # tf.layers.batch_normalization's default
RESTORE = ("they ship with Nystream: restore assets/musicnn/ (git checkout assets/musicnn), "
           "or rebuild it with scripts/convert_musicnn.py")


class BatchNorm(nn.Module):
    """Inference batch norm with TF's epsilon: (x - mean) / sqrt(var + eps) * gamma + beta,
    applied to the last dimension (or to dimension 1 of a (B, C, ...) map with ``dim=1``)."""

    def __init__(self, channels: int):
        super().__init__()
        for name in ("gamma", "beta", "mean", "var"):
            self.register_buffer(name, torch.zeros(channels))

    def scale_shift(self) -> tuple[Tensor, Tensor]:
        scale = self.gamma / torch.sqrt(self.var + BN_EPS)
        return scale, self.beta - self.mean * scale

    def forward(self, x: Tensor, dim: int = -1) -> Tensor:
        scale, shift = self.scale_shift()
        if dim != -1:
            shape = [1] * x.dim()
            shape[dim] = -1
            scale, shift = scale.view(shape), shift.view(shape)
        return x * scale + shift


PRECISION_WORDS = {"float32": "float32", "tf32": "TF32", "bf16": "bf16 products"}


@contextmanager
def precision(mode: str, device: torch.device | str):
    """The network's arithmetic on CUDA (``mode``: PRECISIONS). Default float32, within the error
    model of float32 dot products as on the CPU: TF32 off (torch allows it in cuDNN by default)
    and cuDNN off. cuDNN picks each convolution's algorithm by timing (transform-based ones among
    them), so a stream's values would depend on the batch it ran in. Every computation of the
    network runs inside this, a new slot's silence caches included. Without cuDNN, ``conv1d``
    (the mid-end) is one batched matrix product per tap; other convolutions are ATen's own, one
    product per batch row (so the batched front end keeps every temporal branch's accumulators
    in float32; `--recompute-frontend` convolves its temporal branches).
    "tf32" (`--precision tf32`): cuDNN on, its algorithms chosen by timing, and the matrix
    products and convolutions on the tensor cores with 10-bit mantissas. "bf16" sets them as
    float32 does (its bf16 products, those of ``product_dtype``, sum in float32 on
    CUDA too). Their errors against float32: docs/front-ends.md. The switches are the process's: on CUDA one network
    computes at a time (one engine, one lane); on the CPU (``device``), where they do nothing,
    they are left alone, so that a server's lanes, each pushing in a thread of its own, never
    interleave their settings."""
    if torch.device(device).type != "cuda":
        yield
        return
    tf32 = mode == "tf32"
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    knobs = (matmul, cudnn, cudnn.conv, cudnn.rnn)
    saved = [k.fp32_precision for k in knobs], cudnn.enabled, cudnn.benchmark, matmul.allow_bf16_reduced_precision_reduction
    for k in knobs:
        k.fp32_precision = "tf32" if tf32 else "ieee"
    cudnn.enabled, cudnn.benchmark = tf32, True
    matmul.allow_bf16_reduced_precision_reduction = False      # bf16 products: sums in float32
    try:
        yield
    finally:
        for k, v in zip(knobs, saved[0]):
            k.fp32_precision = v
        cudnn.enabled, cudnn.benchmark, matmul.allow_bf16_reduced_precision_reduction = saved[1:]


def product_dtype(mode: str) -> torch.dtype:
    """The dtype of the continual front ends' products that hold no state: bfloat16 in "bf16",
    else float32. They are the timbral products (each row computed once from its frames and
    kept) and, where a temporal branch is recomputed (the CPU's batch and one stream's push), its
    Toeplitz products: their rounding does not build up over a stream. The temporal branches'
    accumulators (CUDA's default: sums carried from hop to hop), the mid-end and the back-end
    stay float32."""
    return torch.bfloat16 if mode == "bf16" else torch.float32


def bf16_hardware() -> bool:
    """Whether this CPU computes bf16 products natively (avx512_bf16 or AMX); without them
    oneDNN emulates bf16, slower than float32."""
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def precision_problem(mode: str, device: torch.device | str, continual: bool = True) -> str | None:
    """Why the network cannot run in ``mode`` here, or None."""
    kind = torch.device(device).type
    if mode not in PRECISIONS:
        return f"unknown precision {mode!r}; valid: {', '.join(PRECISIONS)}"
    if mode == "tf32" and kind != "cuda":
        return "precision tf32 is for --device cuda (the CPU has no TF32)"
    if mode == "bf16":
        if not continual:
            return "precision bf16 is for the continual front end (the recomputed network is the float32 reference)"
        if kind == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            return f"precision bf16 needs a GPU with bf16 tensor cores ({torch.cuda.get_device_name()} has none)"
        if kind == "cpu" and not bf16_hardware():
            return (f"precision bf16 needs a CPU with avx512_bf16 or AMX (this one: "
                    f"{torch.backends.cpu.get_cpu_capability()}, where bf16 is emulated, slower than float32)")
    return None


def conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, padding: int = 0, *,
           way: str | None = None) -> Tensor:
    """F.conv1d of x (B, C, T) by weight (O, C, k), computed one of three ``way``s:

    * "im2col" (the CPU's default): one matrix product of x's windows (B T', C k) by the weights
      (C k, O). oneDNN's convolution of the mid-end's shapes is slower inside the compiled
      one-stream push, and no faster batched (docs/benchmarks/design.md);
    * "taps" (CUDA's with cuDNN off, ``precision``): k matrix products (O, C) x (B, C, T')
      summed, one batched product per tap, whatever B;
    * "conv" (CUDA's otherwise): F.conv1d, padding by the convolution itself.

    Each output is a float32 dot product of C k terms; the ways differ in its order only."""
    if way is None:
        way = "conv" if x.is_cuda and torch.backends.cudnn.enabled else "taps" if x.is_cuda else "im2col"
    if way == "conv":
        return F.conv1d(x, weight, bias, padding=padding)
    O, C, k = weight.shape
    x = F.pad(x, (padding, padding)) if padding else x
    B, T = x.shape[0], x.shape[-1] - k + 1
    if way == "im2col":
        cols = x.unfold(2, k, 1).permute(0, 2, 1, 3).reshape(B * T, C * k)        # (B T', C k)
        w = weight.reshape(O, C * k).t()
        out = cols @ w if bias is None else torch.addmm(bias, cols, w)             # (B T', O)
        return out.view(B, T, O).transpose(1, 2)
    if way != "taps":
        raise ValueError(f"conv1d: way must be 'im2col', 'taps' or 'conv', not {way!r}")
    out = torch.matmul(weight[:, :, 0], x[..., :T])                     # (B, O, T)
    for j in range(1, k):
        out += torch.matmul(weight[:, :, j], x[..., j:j + T])
    return out if bias is None else out + bias[:, None]


def same_padding(k: int) -> tuple[int, int]:
    """TF's 'same' padding of a length-k kernel: (before, after) = ((k-1)//2, k-1 - (k-1)//2)."""
    return (k - 1) // 2, k - 1 - (k - 1) // 2


def _max_bn_relu(z: Tensor, bn: BatchNorm, dim: int, channel_dim: int = -1) -> Tensor:
    """max over ``dim`` of BN(ReLU(z)), from the max and min of z: BN is monotone per channel
    (increasing when its scale is >= 0, else decreasing) and so is ReLU, so the max of the
    result is BN(ReLU(max z)) or BN(ReLU(min z)); exact, and 4x less elementwise work."""
    lo, hi = z.amin(dim=dim), z.amax(dim=dim)          # (two passes beat torch.aminmax here)
    scale, shift = bn.scale_shift()
    if channel_dim != -1:                      # channels at dim 1 of z -> dim 1 of lo/hi
        scale, shift = scale.view(-1, 1), shift.view(-1, 1)
    return torch.where(scale >= 0, F.relu(hi), F.relu(lo)) * scale + shift


class Musicnn(nn.Module):
    """(B, 187, 96) log-mel -> (B, 50) tag probabilities. Split into stages so that the
    continual front end (audio/musicnn/batch.py) can cache per-frame results."""

    precision = "float32"   # PRECISIONS: the continual front ends' arithmetic (``precision``)

    def __init__(self):
        super().__init__()
        self.input_bn = BatchNorm(1)
        self.timbral = nn.ModuleList(nn.Conv2d(1, TIMBRAL_CH, (7, w)) for w in TIMBRAL)
        self.timbral_bn = nn.ModuleList(BatchNorm(TIMBRAL_CH) for _ in TIMBRAL)
        self.temporal = nn.ModuleList(nn.Conv2d(1, TEMPORAL_CH, (k, 1)) for k in TEMPORAL)
        self.temporal_bn = nn.ModuleList(BatchNorm(TEMPORAL_CH) for _ in TEMPORAL)
        self.mid = nn.ModuleList([nn.Conv1d(FRONT_CH, MID_CH, 7), nn.Conv1d(MID_CH, MID_CH, 7),
                                  nn.Conv1d(MID_CH, MID_CH, 7)])
        self.mid_bn = nn.ModuleList(BatchNorm(MID_CH) for _ in range(3))
        self.pool_bn = BatchNorm(2 * (FRONT_CH + 3 * MID_CH))
        self.dense = nn.Linear(2 * (FRONT_CH + 3 * MID_CH), 200)
        self.dense_bn = BatchNorm(200)
        self.out = nn.Linear(200, TAGS)

    # ------------------------------------------------------------------ stages
    def normalize(self, mel: Tensor) -> Tensor:
        """(B, T, 96) log-mel -> normalised input (B, T, 96)."""
        return self.input_bn(mel.unsqueeze(-1)).squeeze(-1)

    def timbral_valid(self, x: Tensor) -> Tensor:
        """(B, T + 6, 96) normalised frames (any padding already in place) -> (B, T, 408):
        both timbral branches, conv -> ReLU -> BN -> max over frequency, no padding added.
        The conv is one matrix product of 7 x w frequency patches (im2col), each output frame
        computed on its own, so a frame's result does not depend on how many are computed."""
        outs = []
        for conv, bn, w in zip(self.timbral, self.timbral_bn, TIMBRAL):
            patches = x.unfold(1, 7, 1).unfold(2, w, 1)                   # (B, T, 96-w+1, 7, w)
            z = torch.addmm(conv.bias, patches.reshape(-1, 7 * w), conv.weight.flatten(1).t())
            outs.append(_max_bn_relu(z.view(*patches.shape[:3], -1), bn, dim=2))  # (B, T, 204)
        return torch.cat(outs, dim=2)

    def temporal_valid(self, x: Tensor, branch: int) -> Tensor:
        """(B, T + k - 1, 96) normalised frames (padding in place) -> (B, T, 51): temporal branch
        ``branch`` (kernel k = 128, 64, 32 frames), conv -> ReLU -> BN -> max over frequency."""
        z = self.temporal[branch](x.unsqueeze(1))                         # (B, 51, T, 96)
        return _max_bn_relu(z, self.temporal_bn[branch], dim=3, channel_dim=1).transpose(1, 2)

    def temporal_same(self, x: Tensor) -> Tensor:
        """(B, T, 96) normalised patch -> (B, T, 153), 'same' zero padding at the patch edges."""
        return torch.cat([self.temporal_valid(F.pad(x, (0, 0) + same_padding(k)), j)
                          for j, k in enumerate(TEMPORAL)], dim=2)

    def head(self, front: Tensor) -> Tensor:
        """(B, T, 561) front-end features -> (B, 50) logits (mid-end, pooling, dense back-end)."""
        x = front.transpose(1, 2).contiguous()                    # (B, 561, T)
        return self.head_after_conv(x, self.mid_conv(x, 0))

    def mid_conv(self, x: Tensor, i: int) -> Tensor:
        """Mid-end convolution i on x (B, C, T), 'same' zero padding (``conv1d``)."""
        return conv1d(x, self.mid[i].weight, self.mid[i].bias, padding=3)

    def head_after_conv(self, x: Tensor, z: Tensor) -> Tensor:
        """(B, 561, T) front-end features and the first mid-end convolution's output on them
        (B, 64, T) -> (B, 50) logits."""
        feats = [x]
        for i, bn in enumerate(self.mid_bn):
            y = bn(F.relu(z if i == 0 else self.mid_conv(feats[-1], i)), dim=1)
            feats.append(y if i == 0 else y + feats[-1])
        feats = torch.cat(feats, dim=1)                           # (B, 753, T)
        pooled = torch.stack([feats.amax(dim=2), feats.mean(dim=2)], dim=2).flatten(1)  # (B, 1506)
        hidden = self.dense_bn(F.relu(self.dense(self.pool_bn(pooled))))
        return self.out(hidden)

    def forward(self, mel: Tensor) -> Tensor:
        """(B, T, 96) log-mel patch (T = 187 for the trained models) -> (B, 50) taggram."""
        with precision(self.precision, mel.device):
            x = self.normalize(mel)
            timbral = self.timbral_valid(F.pad(x, (0, 0, 3, 3)))
            front = torch.cat([timbral, self.temporal_same(x)], dim=2)
            return torch.sigmoid(self.head(front))


# ----------------------------------------------------------------------------- FLOPs

def timbral_macs_per_frame(columns: int = TIMBRAL_CH) -> int:
    """Both timbral convolutions for one frame, ``columns`` filters each (the continual front
    ends compute TIMBRAL_COLS)."""
    return sum(columns * 7 * w * (BANDS - w + 1) for w in TIMBRAL)


def temporal_macs_per_frame() -> int:
    return TEMPORAL_CH * BANDS * sum(TEMPORAL)


def head_macs(frames: int = PATCH_FRAMES) -> int:
    """Mid-end convolutions on ``frames`` frames plus the dense back-end."""
    return frames * 7 * MID_CH * (FRONT_CH + 2 * MID_CH) + 2 * (FRONT_CH + 3 * MID_CH) * 200 + 200 * TAGS


def patch_macs(frames: int = PATCH_FRAMES) -> int:
    """Multiply-accumulates (convolutions and dense layers) of one taggram recomputed on a patch:
    1,398 M for 187 frames."""
    return frames * (timbral_macs_per_frame() + temporal_macs_per_frame()) + head_macs(frames)


# ----------------------------------------------------------------------------- weights

def tensors_sha256(sd: dict) -> str:
    """Hex sha256 of a state dict's tensors (numpy arrays or tensors): names, dtypes, shapes and
    bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(sd):
        a = np.ascontiguousarray(sd[k].numpy() if isinstance(sd[k], Tensor) else sd[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def weights_file(model: str = "MSD_musicnn") -> Path:
    if model not in MODELS:
        raise MusicnnWeightsError(f"unknown musicnn model {model!r}; shipped: {', '.join(MODELS)}")
    return WEIGHTS_DIR / f"{model}.safetensors"


def load_weights(model: str = "MSD_musicnn") -> tuple[dict[str, Tensor], str]:
    """(state dict, sha256 of the source checkpoint: the weights' identity) from the shipped
    safetensors file; MusicnnWeightsError if it is missing, unreadable or altered."""
    from safetensors import safe_open
    path = weights_file(model)
    if not path.is_file():
        raise MusicnnWeightsError(f"musicnn weights missing: {path}; {RESTORE}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise MusicnnWeightsError(f"musicnn weights {path} are unreadable ({e}); {RESTORE}") from e
    if "weights_sha256" not in meta or tensors_sha256(sd) != meta.get("tensors_sha256"):
        raise MusicnnWeightsError(f"musicnn weights {path} are corrupt (their tensors do not match "
                                  f"the checksum they were written with); {RESTORE}")
    return sd, meta["weights_sha256"]


def build_musicnn(model: str = "MSD_musicnn", *, device: str | torch.device = "cpu") -> tuple[Musicnn, str]:
    """(network in eval mode with the pretrained weights, weights checksum)."""
    net = Musicnn()
    sd, checksum = load_weights(model)
    try:
        net.load_state_dict(sd)
    except RuntimeError as e:
        raise MusicnnWeightsError(f"musicnn weights {weights_file(model)} do not fit the network "
                                  f"({str(e).splitlines()[0]}); {RESTORE}") from e
    return net.eval().to(device), checksum
