"""Read a TensorFlow (v2 "tensor bundle") checkpoint with numpy only: no TensorFlow.

A checkpoint is two files: ``<prefix>.index``, a LevelDB-style sorted table whose values are
``BundleEntryProto`` messages (dtype, shape, shard, offset, size, crc32c), and
``<prefix>.data-00000-of-00001``, the raw little-endian tensor bytes. ``read_checkpoint`` parses
the table (footer -> index block -> data blocks, prefix-compressed keys), decodes each entry's
protobuf fields by hand, slices the data file and verifies every tensor's masked CRC32C.
Only float32/float64/int32/int64 tensors are returned; anything else raises TFCheckpointError.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48
DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<f8"), 3: np.dtype("<i4"), 9: np.dtype("<i8")}


class TFCheckpointError(ValueError):
    """The files are not a readable, intact TensorFlow tensor-bundle checkpoint."""


# ----------------------------------------------------------------------------- bytes

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise TFCheckpointError("truncated varint")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if b < 0x80:
            return value, pos
        shift += 7


def _protobuf_fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs of a serialised protobuf message (wire types 0, 1, 2, 5)."""
    fields, pos = [], 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        else:
            raise TFCheckpointError(f"unsupported protobuf wire type {wire}")
        fields.append((number, value))
    return fields


def _block_entries(table: bytes, offset: int, size: int) -> list[tuple[bytes, bytes]]:
    """Key/value pairs of one table block (uncompressed), keys restored from their prefixes."""
    if offset + size + 5 > len(table):
        raise TFCheckpointError("block handle points past the end of the index file")
    if table[offset + size] != 0:
        raise TFCheckpointError("compressed index blocks are not supported")
    block = table[offset:offset + size]
    restarts = int.from_bytes(block[-4:], "little")
    end = len(block) - 4 * (restarts + 1)
    entries, pos, key = [], 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        vlen, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        entries.append((key, block[pos:pos + vlen]))
        pos += vlen
    return entries


# ----------------------------------------------------------------------------- CRC32C

def _crc_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table[i] = c
    return table


_CRC_TABLE = _crc_table()


def _crc32c_bytes(data: np.ndarray, table: np.ndarray) -> int:   # numba-compiled below
    crc = np.uint32(0xFFFFFFFF)
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> np.uint32(8))
    return crc ^ np.uint32(0xFFFFFFFF)


try:
    import numba
    _crc32c_bytes = numba.njit(cache=False, nogil=True)(_crc32c_bytes)
except ImportError:  # pragma: no cover - numba ships with librosa
    pass


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    return int(_crc32c_bytes(np.frombuffer(data, dtype=np.uint8), _CRC_TABLE))


def masked_crc32c(data: bytes) -> int:
    """The masked form TensorFlow stores: rotate right by 15 bits, add 0xa282ead8."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ----------------------------------------------------------------------------- reader

def _entry(value: bytes) -> dict:
    out = {"dtype": 0, "shape": [], "shard": 0, "offset": 0, "size": 0, "crc32c": None}
    for number, v in _protobuf_fields(value):
        if number == 1:
            out["dtype"] = v
        elif number == 2:
            for dn, dim in _protobuf_fields(v):
                if dn == 2:
                    out["shape"].append(dict(_protobuf_fields(dim)).get(1, 0))
        elif number == 3:
            out["shard"] = v
        elif number == 4:
            out["offset"] = v
        elif number == 5:
            out["size"] = v
        elif number == 6:
            out["crc32c"] = v
        elif number == 7:
            raise TFCheckpointError("partitioned (sliced) tensors are not supported")
    return out


def list_entries(prefix: str | Path) -> dict[str, dict]:
    """name -> {'dtype', 'shape', 'shard', 'offset', 'size', 'crc32c'} from ``<prefix>.index``."""
    index = Path(f"{prefix}.index")
    try:
        table = index.read_bytes()
    except OSError as e:
        raise TFCheckpointError(f"cannot read {index} ({e.strerror or e})") from e
    if len(table) < FOOTER_BYTES or int.from_bytes(table[-8:], "little") != TABLE_MAGIC:
        raise TFCheckpointError(f"{index} is not a TensorFlow checkpoint index (no table magic)")
    footer = table[-FOOTER_BYTES:]
    _, pos = _varint(footer, 0)                       # metaindex handle: offset, size
    _, pos = _varint(footer, pos)
    idx_offset, pos = _varint(footer, pos)
    idx_size, _ = _varint(footer, pos)
    entries = {}
    for _, handle in _block_entries(table, idx_offset, idx_size):
        off, p = _varint(handle, 0)
        size, _ = _varint(handle, p)
        for key, value in _block_entries(table, off, size):
            if key:                                   # the empty key is the bundle header
                entries[key.decode()] = _entry(value)
    if not entries:
        raise TFCheckpointError(f"{index} lists no tensors")
    return entries


def read_checkpoint(prefix: str | Path, names: list[str] | None = None, *,
                    verify: bool = True) -> dict[str, np.ndarray]:
    """name -> array for ``names`` (default: all) of the checkpoint ``prefix``; CRCs verified."""
    entries = list_entries(prefix)
    data_path = Path(f"{prefix}.data-00000-of-00001")
    try:
        data = data_path.read_bytes()
    except OSError as e:
        raise TFCheckpointError(f"cannot read {data_path} ({e.strerror or e})") from e
    out = {}
    for name in names if names is not None else sorted(entries):
        if name not in entries:
            raise TFCheckpointError(f"{prefix} has no tensor {name!r}")
        e = entries[name]
        if e["shard"] != 0:
            raise TFCheckpointError(f"{name}: multi-shard checkpoints are not supported")
        if e["dtype"] not in DTYPES:
            raise TFCheckpointError(f"{name}: unsupported dtype code {e['dtype']}")
        dtype = DTYPES[e["dtype"]]
        count = int(np.prod(e["shape"], dtype=np.int64)) if e["shape"] else 1
        if e["size"] != count * dtype.itemsize or e["offset"] + e["size"] > len(data):
            raise TFCheckpointError(f"{name}: {e['size']} bytes at {e['offset']} do not fit shape "
                                    f"{e['shape']} in {data_path} ({len(data)} bytes); truncated?")
        raw = data[e["offset"]:e["offset"] + e["size"]]
        if verify and e["crc32c"] is not None and masked_crc32c(raw) != e["crc32c"]:
            raise TFCheckpointError(f"{name}: CRC32C mismatch in {data_path}: the file is corrupt")
        out[name] = np.frombuffer(raw, dtype=dtype).reshape(e["shape"]).copy()
    return out
