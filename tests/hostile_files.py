"""Crafted files an attacker could hand the app, generated here (never stored in the repository).

Each maker writes one file and returns its path. The big ones are bombs: small on disk, gigabytes
once a careless loader inflates, folds or allocates what they claim.
"""
from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np

GIB = 1 << 30


def pickling_settings(path: Path, marker: Path, valid: str, key: str) -> Path:
    """A Qt INI settings file whose ``key`` is a ``@Variant`` holding a PySide6 PyObjectWrapper,
    whose pickle creates ``marker`` when unpickled; ``valid``: INI text put before it."""
    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    blob = pickle.dumps(Payload(), protocol=2)
    name = b"PySide::PyObjectWrapper\0"
    data = struct.pack(">I", 0x7F) + struct.pack(">I", len(name)) + name + struct.pack(">I", len(blob)) + blob
    section, _, field = key.partition("/")
    value = "@Variant(" + "".join(f"\\x{b:02x}" for b in data) + ")"
    path.write_text(f"{valid}[{section}]\n{field}={value}\n")
    return path


def deflate_checkpoint(path: Path, inflated: int = 3 * GIB // 2) -> Path:
    """A torch.save-shaped zip whose data.pkl is a DEFLATE member of ``inflated`` bytes (a pickle
    of one long string): about 1/1000 of that on disk."""
    header = b"\x80\x02\x8d" + struct.pack("<Q", inflated - 12)      # PROTO 2, BINUNICODE8 n
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        z.writestr("archive/version", "3\n")
        with z.open("archive/data.pkl", "w", force_zip64=True) as f:
            f.write(header)
            chunk = b"a" * (64 << 20)
            left = inflated - 12
            while left > 0:
                f.write(chunk[:min(left, len(chunk))])
                left -= len(chunk)
            f.write(b".")
    return path


def lying_checkpoint(path: Path, claimed: int = 3 * GIB) -> Path:
    """A stored zip whose central directory claims ``claimed`` bytes for a 10-byte member."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02N." + b"\0" * 6)
    data = bytearray(path.read_bytes())
    cd = data.rfind(b"PK\x01\x02")                                       # the central directory entry
    data[cd + 24:cd + 28] = struct.pack("<I", min(claimed, 0xFFFFFFFE))  # uncompressed size
    path.write_bytes(bytes(data))
    return path


def onnx_folding_bomb(path: Path, side: int = 16384, metadata: dict | None = None) -> Path:
    """A graph whose one node is ConstantOfShape (side, side): 180 bytes on disk, side^2 floats
    when ONNX Runtime folds it. ``metadata``: Nystream metadata to carry (else a real export's)."""
    import onnx
    from onnx import TensorProto, helper

    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [side, side])
    node = helper.make_node("ConstantOfShape", ["shape"], ["big"],
                            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))
    graph = helper.make_graph([node], "bomb", [], [helper.make_tensor_value_info("big", TensorProto.FLOAT, None)],
                              initializer=[shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    for k, v in (metadata if metadata is not None else export_metadata()).items():
        model.metadata_props.add(key=k, value=v)
    onnx.save(model, str(path))
    return path


def export_metadata(**changes) -> dict:
    """The metadata of a real 1-block continual export of a small musicnn-token model."""
    from models.config import ModelConfig
    cfg = ModelConfig(variant="continual", in_dim=50, d_model=32, heads=4, ff_dim=64, window=8).to_dict()
    meta = {"nystream": "stream-step", "kind": "continual", "config": cfg,
            "classes": [f"genre{i}" for i in range(10)],
            "frontend": {"name": "musicnn", "token_dim": 50, "spacing_hops": 4}}
    meta.update(changes)
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


def token_file_huge_label(path: Path, label: int = 2**31) -> Path:
    """A small token file with no genres and one label of ``label``."""
    np.savez(path, X=np.zeros((2, 3, 4), np.float32), labels=np.array([0, label], np.int64))
    return path


def token_file_huge_shape(path: Path) -> Path:
    """A token file whose X header declares (2^20, 2^10, 2^10) float32 (4 TiB) over 16 bytes."""
    buf = bytearray()
    header = {"descr": "<f4", "fortran_order": False, "shape": (1 << 20, 1 << 10, 1 << 10)}
    text = repr(header).encode("latin1")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    buf += b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + b"\0" * 16
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("X.npy", bytes(buf))
        z.writestr("labels.npy", npy(np.zeros(2, np.int64)))
    return path


def npy(a: np.ndarray) -> bytes:
    import io
    f = io.BytesIO()
    np.save(f, a)
    return f.getvalue()


def flac_claiming(path: Path, frames: int = (1 << 36) - 1, rate: int = 16000) -> Path:
    """A real FLAC file (a second of silence) whose STREAMINFO claims ``frames`` frames at ``rate``."""
    data = encoded(np.zeros(16000, np.float32), 16000, "FLAC")
    # STREAMINFO: 'fLaC', block header (4), min/max block (4), min/max frame (6), then 64 bits:
    # 20 rate, 3 channels-1, 5 bits-1, 36 total samples
    at = 4 + 4 + 10
    bits = int.from_bytes(data[at:at + 8], "big")
    channels_bits = (bits >> 36) & 0xFF
    bits = (rate << 44) | (channels_bits << 36) | (frames & ((1 << 36) - 1))
    data[at:at + 8] = bits.to_bytes(8, "big")
    path.write_bytes(bytes(data))
    return path


def wav_claiming(path: Path, rate: int = 1, frames: int | None = None) -> Path:
    """A WAV (16-bit mono) whose header says ``rate`` Hz and, with ``frames``, a data size of
    that many frames (over a file of 1000)."""
    data = encoded(np.zeros(1000, np.float32), 16000, "WAV")
    data[24:28] = struct.pack("<I", rate)
    data[28:32] = struct.pack("<I", rate * 2)
    if frames is not None:
        size = min(frames * 2, 0xFFFFFF00)
        data[40:44] = struct.pack("<I", size)
        data[4:8] = struct.pack("<I", size + 36)
    path.write_bytes(bytes(data))
    return path


def encoded(x: np.ndarray, rate: int, fmt: str) -> bytearray:
    """``x`` as the bytes of a 16-bit file of format ``fmt`` (written to any name afterwards)."""
    import io

    import soundfile as sf
    f = io.BytesIO()
    sf.write(f, x, rate, format=fmt, subtype="PCM_16")
    return bytearray(f.getvalue())
