"""musicnn (Pons & Serra, 2019) in torch: the MSD- or MTT-trained music tagger whose weights ship
with the PyPI package ``musicnn`` 0.1.0, read without TensorFlow.

Input: a patch of 187 log-mel frames x 96 bands (audio/musicnn_mel.py). Network, as the
package's ``models.py`` defines it (TF layout: time is the height axis):

  input batch norm (one scalar pair)
  timbral:  conv 7x38 and 7x67 (204 ch each, time zero-padded by 3, valid in frequency)
  temporal: conv 128x1, 64x1, 32x1 (51 ch each, 'same' padding in time)
            each conv -> ReLU -> batch norm -> max over frequency      -> (T, 561)
  mid-end:  conv 7x561 -> 64, then two 7x64 -> 64 with residuals (each conv -> ReLU -> BN)
  back-end: max and mean over time of the 753-ch concatenation (interleaved max, mean),
            BN -> dense 1506 -> 200, ReLU -> BN -> dense 200 -> 50 -> sigmoid = taggram (50,)

Weights: ``<site-packages>/musicnn/<MODEL>/`` is read with audio/tf_checkpoint.py (CRC32C
verified), converted once to a torch state dict and cached under ``~/.cache/nystream/`` together
with the sha256 of the source files; a cache whose checksum does not match is rebuilt.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .checksums import file_sha256
from .errors import MusicnnWeightsError
from .tf_checkpoint import TFCheckpointError, read_checkpoint

MODELS = ("MSD_musicnn", "MTT_musicnn")
PATCH_FRAMES = 187
BANDS = 96
TAGS = 50
TIMBRAL = (38, 67)            # kernel widths in frequency (0.4 and 0.7 of 96 bands)
TIMBRAL_CH = 204
TEMPORAL = (128, 64, 32)      # kernel lengths in time
TEMPORAL_CH = 51
FRONT_CH = 2 * TIMBRAL_CH + 3 * TEMPORAL_CH      # 561
MID_CH = 64
BN_EPS = 1e-3                 # tf.layers.batch_normalization's default
INSTALL = "pip install --no-deps musicnn==0.1.0 (or: make setup)"
REINSTALL = "pip install --no-deps --force-reinstall musicnn==0.1.0"
CACHE_VERSION = 1


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
    continual front end (audio/musicnn_stream.py) can cache per-frame results."""

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
        x = front.transpose(1, 2)                                 # (B, 561, T)
        feats = [x]
        for i, (conv, bn) in enumerate(zip(self.mid, self.mid_bn)):
            y = bn(F.relu(conv(F.pad(feats[-1], (3, 3)))), dim=1)
            feats.append(y if i == 0 else y + feats[-1])
        feats = torch.cat(feats, dim=1)                           # (B, 753, T)
        pooled = torch.stack([feats.amax(dim=2), feats.mean(dim=2)], dim=2).flatten(1)  # (B, 1506)
        hidden = self.dense_bn(F.relu(self.dense(self.pool_bn(pooled))))
        return self.out(hidden)

    def forward(self, mel: Tensor) -> Tensor:
        """(B, T, 96) log-mel patch (T = 187 for the trained models) -> (B, 50) taggram."""
        x = self.normalize(mel)
        timbral = self.timbral_valid(F.pad(x, (0, 0, 3, 3)))
        front = torch.cat([timbral, self.temporal_same(x)], dim=2)
        return torch.sigmoid(self.head(front))


# ----------------------------------------------------------------------------- FLOPs

def timbral_macs_per_frame() -> int:
    return sum(TIMBRAL_CH * 7 * w * (BANDS - w + 1) for w in TIMBRAL)


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

def package_dir(model: str = "MSD_musicnn") -> Path:
    """``<site-packages>/musicnn/<model>/`` without importing the package (it needs TF 1)."""
    if model not in MODELS:
        raise MusicnnWeightsError(f"unknown musicnn model {model!r}; valid: {', '.join(MODELS)}")
    spec = importlib.util.find_spec("musicnn")
    if spec is None or not spec.submodule_search_locations:
        raise MusicnnWeightsError(f"the musicnn package (pretrained weights) is not installed; "
                                  f"install it with: {INSTALL}")
    return Path(list(spec.submodule_search_locations)[0]) / model


def convert(prefix: Path) -> dict[str, Tensor]:
    """Our state dict from the TF checkpoint ``prefix`` (e.g. ``.../MSD_musicnn/``)."""
    names = ([f"batch_normalization{'' if i == 0 else f'_{i}'}/{v}" for i in range(11)
              for v in ("gamma", "beta", "moving_mean", "moving_variance")]
             + [f"conv2d{'' if i == 0 else f'_{i}'}/{v}" for i in range(8) for v in ("kernel", "bias")]
             + [f"dense{s}/{v}" for s in ("", "_1") for v in ("kernel", "bias")])
    tf = read_checkpoint(f"{prefix}/", names)     # files <dir>/.index, <dir>/.data-*
    sd = {}

    def bn(ours: str, i: int):
        src = f"batch_normalization{'' if i == 0 else f'_{i}'}"
        for a, b in (("gamma", "gamma"), ("beta", "beta"), ("mean", "moving_mean"), ("var", "moving_variance")):
            sd[f"{ours}.{a}"] = torch.from_numpy(tf[f"{src}/{b}"])

    def conv(ours: str, i: int, one_d: bool):
        k = tf[f"conv2d{'' if i == 0 else f'_{i}'}/kernel"]                 # (kt, kf, 1, out)
        w = k[:, :, 0, :].transpose(2, 1, 0) if one_d else k.transpose(3, 2, 0, 1)
        sd[f"{ours}.weight"] = torch.from_numpy(np.ascontiguousarray(w))
        sd[f"{ours}.bias"] = torch.from_numpy(tf[f"conv2d{'' if i == 0 else f'_{i}'}/bias"])

    bn("input_bn", 0)
    for j in range(2):
        conv(f"timbral.{j}", j, False)
        bn(f"timbral_bn.{j}", 1 + j)
    for j in range(3):
        conv(f"temporal.{j}", 2 + j, False)
        bn(f"temporal_bn.{j}", 3 + j)
        conv(f"mid.{j}", 5 + j, True)
        bn(f"mid_bn.{j}", 6 + j)
    bn("pool_bn", 9)
    bn("dense_bn", 10)
    for ours, src in (("dense", "dense"), ("out", "dense_1")):
        sd[f"{ours}.weight"] = torch.from_numpy(np.ascontiguousarray(tf[f"{src}/kernel"].T))
        sd[f"{ours}.bias"] = torch.from_numpy(tf[f"{src}/bias"])
    return sd


def cache_dir() -> Path:
    """``$NYSTREAM_CACHE``, else ``$XDG_CACHE_HOME/nystream``, else ``~/.cache/nystream``."""
    if os.environ.get("NYSTREAM_CACHE"):
        return Path(os.environ["NYSTREAM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nystream"


def load_weights(model: str = "MSD_musicnn") -> tuple[dict[str, Tensor], str]:
    """(state dict, sha256 of the package's checkpoint files): from the cache when its checksum
    matches the installed files, else converted from them (and cached)."""
    src = package_dir(model)
    files = [src / ".index", src / ".data-00000-of-00001"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise MusicnnWeightsError(f"musicnn checkpoint files missing: {', '.join(missing)}; "
                                  f"reinstall with: {REINSTALL}")
    checksum = file_sha256(*files)
    cached = cache_dir() / f"{model}-v{CACHE_VERSION}.pt"
    if cached.is_file():
        try:
            payload = torch.load(cached, map_location="cpu", weights_only=True)
            if payload.get("sha256") == checksum:
                return payload["state_dict"], checksum
        except Exception:  # noqa: BLE001 - a damaged cache is rebuilt below
            pass
    try:
        sd = convert(src)
    except TFCheckpointError as e:
        raise MusicnnWeightsError(f"the musicnn checkpoint in {src} is unreadable or corrupt ({e}); "
                                  f"reinstall with: {REINSTALL}") from e
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        torch.save({"sha256": checksum, "model": model, "state_dict": sd}, tmp)
        os.replace(tmp, cached)
    except OSError:
        pass                                  # a read-only home: convert again next time
    return sd, checksum


def build_musicnn(model: str = "MSD_musicnn", *, device: str | torch.device = "cpu") -> tuple[Musicnn, str]:
    """(network in eval mode with the pretrained weights, weights checksum)."""
    net = Musicnn()
    sd, checksum = load_weights(model)
    net.load_state_dict(sd)
    return net.eval().to(device), checksum
