"""Convert the pretrained musicnn weights of the PyPI package ``musicnn`` 0.1.0 (a TensorFlow 1
checkpoint) to the safetensors file the app ships, ``assets/musicnn/<MODEL>.safetensors``.

Run once, after ``pip install --no-deps musicnn==0.1.0`` (its own requirements pin TensorFlow 1,
which is never needed: scripts/tf_checkpoint.py reads the checkpoint with numpy and verifies
every tensor's CRC32C):

    python scripts/convert_musicnn.py [--model MSD_musicnn] [--out FILE]

Only the tensors inference uses are kept (weights, biases and batch-norm statistics: no optimiser
state), renamed and laid out as audio/musicnn/__init__.py's ``Musicnn`` state dict.
tests/audio/test_audio_musicnn.py checks that the shipped file holds the same tensors, bit for
bit, and the same metadata as a fresh conversion of the installed wheel (the header's key order
is the safetensors library's, so the files are compared by content, not byte for byte).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]
from tf_checkpoint import read_checkpoint  # noqa: E402

from audio.checksums import file_sha256  # noqa: E402
from audio.musicnn import tensors_sha256  # noqa: E402
SOURCE = "musicnn 0.1.0 (PyPI, ISC licence, Music Technology Group, Universitat Pompeu Fabra)"


def package_dir(model: str) -> Path:
    """``<site-packages>/musicnn/<model>/``, without importing the package (it needs TF 1)."""
    spec = importlib.util.find_spec("musicnn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the musicnn package is not installed: pip install --no-deps musicnn==0.1.0")
    return Path(list(spec.submodule_search_locations)[0]) / model


def convert(prefix: Path) -> dict[str, np.ndarray]:
    """The ``Musicnn`` state dict (name -> float32 array) from the TF checkpoint ``prefix``."""
    def name(base: str, i: int) -> str:
        return f"{base}{'' if i == 0 else f'_{i}'}"
    names = ([f"{name('batch_normalization', i)}/{v}" for i in range(11)
              for v in ("gamma", "beta", "moving_mean", "moving_variance")]
             + [f"{name('conv2d', i)}/{v}" for i in range(8) for v in ("kernel", "bias")]
             + [f"dense{s}/{v}" for s in ("", "_1") for v in ("kernel", "bias")])
    tf = read_checkpoint(f"{prefix}/", names)     # files <dir>/.index, <dir>/.data-*
    sd = {}

    def bn(ours: str, i: int):
        for a, b in (("gamma", "gamma"), ("beta", "beta"), ("mean", "moving_mean"), ("var", "moving_variance")):
            sd[f"{ours}.{a}"] = tf[f"{name('batch_normalization', i)}/{b}"]

    def conv(ours: str, i: int, one_d: bool):
        k = tf[f"{name('conv2d', i)}/kernel"]                            # (kt, kf, 1, out)
        sd[f"{ours}.weight"] = k[:, :, 0, :].transpose(2, 1, 0) if one_d else k.transpose(3, 2, 0, 1)
        sd[f"{ours}.bias"] = tf[f"{name('conv2d', i)}/bias"]

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
        sd[f"{ours}.weight"] = tf[f"{src}/kernel"].T
        sd[f"{ours}.bias"] = tf[f"{src}/bias"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}


def write(model: str, out: Path) -> Path:
    """Convert ``model`` to ``out``. Metadata: the source, the sha256 of the source checkpoint's
    files (the weights' identity, which token files and trained checkpoints record) and of the
    tensors' bytes (checked at every load)."""
    from safetensors.numpy import save_file
    src = package_dir(model)
    sd = convert(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out), metadata={
        "model": model, "source": SOURCE,
        "weights_sha256": file_sha256(src / ".index", src / ".data-00000-of-00001"),
        "tensors_sha256": tensors_sha256(sd)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="MSD_musicnn", choices=("MSD_musicnn", "MTT_musicnn"))
    p.add_argument("--out", type=Path, help="default: assets/musicnn/<MODEL>.safetensors")
    args = p.parse_args(argv)
    out = write(args.model, args.out or ROOT / "assets" / "musicnn" / f"{args.model}.safetensors")
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
