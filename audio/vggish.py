"""VGGish (torchvggish's architecture) with AudioSet weights, or seeded random weights.

Weights are looked for in this order: an explicit path (CLI ``--vggish-weights``), the environment
variable NYSTREAM_VGGISH_WEIGHTS, the torch hub cache file torchvggish itself uses
(``<torch hub dir>/checkpoints/vggish-10086976.pth``), then, when online, torchvggish's own download
(with progress, into that cache). A file is checked (keys and shapes) and loaded with
``weights_only=True``. Tokens are the raw 128-d embedding (the last ReLU layer); AudioSet's PCA +
8-bit quantisation is applied only when asked for (``postprocess=True``), because it was made for
storage compatibility, not accuracy, and needs a second file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checksums import file_sha256
from .errors import VGGishWeightsError

WEIGHTS_FILE = "vggish-10086976.pth"
PCA_FILE = "vggish_pca_params-970ea276.pth"
ENV_VAR = "NYSTREAM_VGGISH_WEIGHTS"


def _architecture() -> torch.nn.Module:
    """VGGish's layers with their parameters allocated, not initialised: every caller fills them
    (AudioSet weights, or a seeded random init); torch's default init of its 72 M parameters
    would take a third of a second to be thrown away. Built on the meta device, each parameter
    then replaced by an empty one (it has no buffers): ``Module.to_empty`` would import sympy
    for its meta kernels, another third of a second in a fresh engine process."""
    from torchvggish.torchvggish import VGG, make_layers
    with torch.device("meta"):
        model = VGG(make_layers(), postprocess=False)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad))
    return model


def _urls() -> tuple[str, str]:
    from torchvggish.torchvggish import PCA_PARAMS, VGGISH_WEIGHTS
    return VGGISH_WEIGHTS, PCA_PARAMS


def hub_cache_path(name: str = WEIGHTS_FILE) -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / name


def where_to_put_weights() -> str:
    return (f"put the AudioSet VGGish weights ({WEIGHTS_FILE}, from torchvggish's v0.1 release) at "
            f"{hub_cache_path()} or pass --vggish-weights FILE (or set {ENV_VAR}); "
            f"--random-vggish runs the real architecture with random weights instead")


def load_state_dict(path: Path) -> dict:
    """A VGGish state dict from ``path``, checked against the architecture."""
    if not path.is_file():
        raise VGGishWeightsError(f"VGGish weights not found at {path}; " + where_to_put_weights())
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise VGGishWeightsError(f"{path} is not a readable torch state dict ({e}); "
                                 + where_to_put_weights()) from e
    if not isinstance(state, dict):
        raise VGGishWeightsError(f"{path} holds a {type(state).__name__}, not a state dict")
    expected = _architecture().state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = sorted(k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape))
    if missing or extra or wrong:
        raise VGGishWeightsError(
            f"{path} is not a VGGish state dict: missing {missing[:4]}, unexpected {extra[:4]}, "
            f"wrong shapes {wrong[:4]}; " + where_to_put_weights())
    return state


def resolve_weights(path: str | Path | None = None, *, allow_download: bool = True) -> Path:
    """Where the weights come from (see module docstring); raises VGGishWeightsError."""
    if path is not None:
        return Path(path)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    cached = hub_cache_path()
    if cached.is_file() or not allow_download:
        return cached
    url, _ = _urls()
    try:
        torch.hub.load_state_dict_from_url(url, progress=True, check_hash=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - offline, proxy, HTTP errors
        raise VGGishWeightsError(f"VGGish weights are not on this machine and the download "
                                 f"failed ({e}); " + where_to_put_weights()) from e
    return cached


@dataclass
class Embedder:
    """Patches (N, 96, 64) -> tokens (N, 128). ``description`` says which weights made them."""
    model: torch.nn.Module
    device: torch.device
    random: bool
    description: str
    checksum: str                    # sha256 of the weights file, or 'random-<seed>'
    pca: tuple | None = None         # (eigen vectors (128, 128), means (128, 1))

    @torch.no_grad()
    def __call__(self, patches) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(patches, dtype=np.float32), device=self.device)
        if x.dim() == 2:
            x = x.unsqueeze(0)
        if x.shape[-2:] != (96, 64):
            raise ValueError(f"VGGish patches must be (N, 96, 64), got {tuple(x.shape)}")
        out = self.model(x.unsqueeze(1))                           # (N, 128)
        if self.pca is not None:
            vectors, means = self.pca
            out = torch.mm(vectors, out.t() - means).t().clamp(-2.0, 2.0)
            out = torch.round((out + 2.0) * (255.0 / 4.0))
        return out.float().cpu()


def build_embedder(weights: str | Path | None = None, *, random_seed: int | None = None,
                   device: str | torch.device = "cpu", postprocess: bool = False,
                   allow_download: bool = True) -> Embedder:
    """VGGish ready to embed: AudioSet weights (resolved as documented), or random if seeded."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        device = torch.device("cpu")
    model = _architecture()
    if random_seed is not None:
        g = torch.Generator().manual_seed(random_seed)
        with torch.no_grad():
            for p in model.parameters():                  # seeded, unit-gain init: O(1) tokens
                if p.dim() > 1:                           # (in place: randn's values, one pass)
                    p.normal_(0.0, (1.0 / p[0].numel()) ** 0.5, generator=g)
                else:
                    p.zero_()
        desc, checksum = f"RANDOM VGGish weights (seed {random_seed})", f"random-{random_seed}"
    else:
        path = resolve_weights(weights, allow_download=allow_download)
        model.load_state_dict(load_state_dict(path))
        desc, checksum = f"AudioSet VGGish weights ({path})", file_sha256(path)
    pca = None
    if postprocess:
        pca_path = hub_cache_path(PCA_FILE)
        if not pca_path.is_file():
            raise VGGishWeightsError(f"postprocessing needs the PCA parameters {PCA_FILE} in "
                                     f"{pca_path.parent}")
        params = torch.load(pca_path, map_location="cpu", weights_only=True)
        pca = (torch.as_tensor(params["pca_eigen_vectors"]).float().to(device),
               torch.as_tensor(params["pca_means"]).reshape(-1, 1).float().to(device))
    return Embedder(model.eval().to(device), device, random_seed is not None, desc, checksum, pca)


def vggish_flops() -> int:
    """FLOPs (2 x MACs) of VGGish on one 96 x 64 patch: 4 conv stages + 3 dense layers."""
    macs, h, w, cin = 0, 96, 64, 1
    for cout, convs in ((64, 1), (128, 1), (256, 2), (512, 2)):
        for _ in range(convs):
            macs += h * w * 9 * cin * cout
            cin = cout
        h, w = h // 2, w // 2
    macs += cin * h * w * 4096 + 4096 * 4096 + 4096 * 128
    return 2 * macs
