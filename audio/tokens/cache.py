"""Token files: any (N, T, D) token sequences with labels, written atomically as .npz.

Keys: X (N, T, D) float32 (zero beyond each sequence's length), lengths (N,), labels (N,),
ids (N,) track ids, genres (C,) class names, split (N,) '' or a predefined 'train'/'val'/'test',
metadata (a JSON string: front end settings, VGGish weights checksum or 'random-<seed>',
skipped files, source). The musicnn GTZAN taggrams convert to the same format.
"""
from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import AudioError
from ..files import atomic_write
from ..gtzan import GENRES, MAX_CLASS_NAME, MAX_CLASSES

KEYS = ("X", "lengths", "labels", "ids", "genres", "split", "metadata")
MAX_BYTES = 2 << 30         # every array of a token file, as declared (GTZAN's VGGish tokens: 61 MB)
MAX_TEXT = {"ids": 1024, "genres": MAX_CLASS_NAME, "split": 8, "metadata": 1 << 22}    # characters per entry
KINDS = {"X": "f", "lengths": "iu", "labels": "iuf", "ids": "U", "genres": "U", "split": "U", "metadata": "U"}
NDIM = {"X": 3, "lengths": 1, "labels": 1, "ids": 1, "genres": 1, "split": 1, "metadata": 0}


class TokenFileError(AudioError):
    """A token file that is missing, unreadable or malformed."""


@dataclass
class TokenSet:
    X: np.ndarray            # (N, T, D) float32
    lengths: np.ndarray      # (N,) int64
    labels: np.ndarray       # (N,) int64
    ids: np.ndarray          # (N,) str
    genres: tuple[str, ...]
    split: np.ndarray        # (N,) str, '' when none is predefined
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        N = len(self.labels)
        if self.X.ndim != 3 or 0 in self.X.shape[1:]:
            raise TokenFileError(f"X must be (N, T, D) token sequences with T, D >= 1, got shape {self.X.shape}")
        if self.labels.dtype.kind not in "iu":
            raise TokenFileError(f"labels must be integers (class indices), got {self.labels.dtype}")
        bad = ~np.isfinite(self.X)
        if bad.any():
            rows = np.flatnonzero(bad.any(axis=(1, 2)))
            t = int(np.flatnonzero(bad[rows[0]].any(axis=1))[0])
            raise TokenFileError(f"X holds {int(bad.sum())} non-finite values in {len(rows)} sequence(s), "
                                 f"the first in row {rows[0]} (track {str(self.ids[rows[0]])!r}) at token {t}; "
                                 f"make the token file again (python main.py extract)")
        for name, arr in (("X", self.X), ("lengths", self.lengths), ("ids", self.ids),
                          ("split", self.split)):
            if len(arr) != N:
                raise TokenFileError(f"{name} has {len(arr)} entries, labels has {N}")
        if N and (self.labels.min() < 0 or self.labels.max() >= len(self.genres)):
            raise TokenFileError(f"labels must lie in [0, {len(self.genres)}), got "
                                 f"{self.labels.min()}..{self.labels.max()}")
        if N and (self.lengths.min() < 1 or self.lengths.max() > self.X.shape[1]):
            raise TokenFileError(f"lengths must lie in [1, T={self.X.shape[1]}]")
        check_names("genres", self.genres, unique=True)
        check_names("ids", self.ids.tolist(), unique=False)
        odd = sorted(set(self.split.tolist()) - {"", "train", "val", "test"})
        if odd:
            raise TokenFileError(f"split holds {odd[0]!r}; a split entry is 'train', 'val', 'test' or ''")
        check_metadata(self.metadata, self.X.shape[2])


def check_names(what: str, names, unique: bool) -> None:
    """Names that print and save anywhere: non-empty, valid UTF-8, (unique)."""
    for i, name in enumerate(names):
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise TokenFileError(f"{what}[{i}] is not valid UTF-8: {ascii(name)}") from None
        if not name.strip():
            raise TokenFileError(f"{what}[{i}] is empty")
        if not name.isprintable():
            raise TokenFileError(f"{what}[{i}] holds control characters: {ascii(name)[:60]}")
    if unique and len(set(names)) != len(names):
        twice = next(n for n in names if list(names).count(n) > 1)
        raise TokenFileError(f"{what} names {twice!r} twice")


def check_metadata(metadata, dim: int) -> None:
    """The metadata must describe the arrays it comes with (else a model trained on them would
    record a front end whose tokens it cannot take)."""
    if not isinstance(metadata, dict):
        raise TokenFileError(f"metadata must be a JSON object, got {type(metadata).__name__}")
    said = {"dim": metadata.get("dim")}
    fe = metadata.get("frontend_info")
    if fe is not None:
        if not isinstance(fe, dict) or not isinstance(fe.get("name"), str):
            raise TokenFileError("metadata.frontend_info must be an object with the front end's 'name'")
        said[f"frontend_info.token_dim ({fe['name']})"] = fe.get("token_dim")
        spacing = fe.get("spacing_hops", 1)
        if type(spacing) is not int or spacing < 1:
            raise TokenFileError(f"metadata.frontend_info.spacing_hops must be a positive integer, "
                                 f"got {spacing!r}")
    for key, value in said.items():
        if value is not None and value != dim:
            raise TokenFileError(f"the arrays and the metadata disagree: metadata.{key} says "
                                 f"{value!r}-d tokens, X holds {dim}-d tokens; make the token file "
                                 f"again (python main.py extract)")


def save_tokens(path: str | Path, tokens: TokenSet) -> None:
    """Write ``tokens`` to ``path`` atomically and durably (a crash never leaves a part of it)."""
    metadata = json.dumps(tokens.metadata, allow_nan=False)
    atomic_write(path, lambda f: np.savez(
        f, X=tokens.X.astype(np.float32), lengths=tokens.lengths.astype(np.int64),
        labels=tokens.labels.astype(np.int64), ids=tokens.ids.astype(str),
        genres=np.array(tokens.genres, dtype=str), split=tokens.split.astype(str),
        metadata=np.array(metadata)))


def array_headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name -> (shape, dtype) of each array of an .npz, read from the .npy headers alone (no data)."""
    headers = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0)):
                    raise TokenFileError(f"array {info.filename[:40]!r} has .npy format {version}, not 1.0 or 2.0")
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
            if math.prod(shape) * dtype.itemsize > info.file_size:
                raise TokenFileError(f"array {info.filename[:40]!r} declares shape {shape} of {dtype}, "
                                     f"more than its {info.file_size:,} bytes")
            headers[info.filename[:-4]] = (tuple(shape), dtype)
    return headers


def check_headers(headers: dict) -> None:
    """Shapes, dtypes and sizes a token file may declare; TokenFileError (one line) else."""
    for key, (shape, dtype) in headers.items():
        if key not in KINDS:
            continue
        if dtype.kind not in KINDS[key] or len(shape) != NDIM[key]:
            what = ("(N, T, D) token sequences of floats" if key == "X" else f"a {NDIM[key]}-d array of "
                    + dict(f="floats", iu="integers", iuf="numbers", U="text")[KINDS[key]])
            raise TokenFileError(f"{key} must be {what}, got shape {shape} of {dtype}")
        if dtype.kind == "U" and dtype.itemsize // 4 > MAX_TEXT[key]:
            raise TokenFileError(f"{key} holds text of up to {dtype.itemsize // 4:,} characters an entry, "
                                 f"over the {MAX_TEXT[key]:,} a token file may have")
    total = sum(math.prod(s) * d.itemsize for k, (s, d) in headers.items() if k in KINDS)
    if total > MAX_BYTES:
        raise TokenFileError(f"its arrays declare {total / 2**20:,.0f} MB, over the {MAX_BYTES / 2**20:,.0f} MB "
                             f"a token file may have: not loaded")
    N = headers["labels"][0][0] if "labels" in headers else 0
    for key in ("lengths", "ids", "split"):
        if key in headers and headers[key][0] != (N,):
            raise TokenFileError(f"{key} has shape {headers[key][0]}, labels has {N} entries")
    if "genres" in headers and headers["genres"][0][0] > MAX_CLASSES:
        raise TokenFileError(f"genres names {headers['genres'][0][0]:,} classes, over {MAX_CLASSES:,}")


def load_tokens(path: str | Path) -> TokenSet:
    path = Path(path)
    try:
        if not path.is_file():
            raise TokenFileError(f"token file not found: {path}")
        check_headers(array_headers(path))              # before any array is read
        with np.load(path, allow_pickle=False) as d:
            missing = [k for k in ("X", "labels") if k not in d.files]
            if missing:
                raise TokenFileError(f"{path} has no {', '.join(missing)}: a token file holds "
                                     f"X (N, T, D) and labels (N,)")
            X = d["X"]
            N = len(d["labels"])
            T = X.shape[1] if X.ndim == 3 else 0
            get = lambda k, default: d[k] if k in d.files else default  # noqa: E731
            labels = d["labels"]
            if labels.dtype.kind not in "iu":
                raise TokenFileError(f"{path}: labels must be integers (class indices), got {labels.dtype}"
                                     + (f" (row 0: {labels.flat[0].item()!r})" if labels.size else ""))
            return TokenSet(
                X=X.astype(np.float32), labels=labels.astype(np.int64),
                lengths=get("lengths", np.full(N, T)).astype(np.int64),
                ids=get("ids", np.array([str(i) for i in range(N)])).astype(str),
                genres=(tuple(str(g) for g in d["genres"]) if "genres" in d.files
                        else unnamed_classes(labels)),
                split=get("split", np.array([""] * N)).astype(str),
                metadata=json.loads(str(get("metadata", np.array("{}")))))
    except TokenFileError as e:
        raise e if str(path) in str(e) else TokenFileError(f"{path}: {e}") from e
    except PermissionError as e:
        raise TokenFileError(f"{path} cannot be read: permission denied") from e
    except Exception as e:  # noqa: BLE001 - zip, pickle and value errors
        raise TokenFileError(f"{path} is not a readable token file ({e})") from e


def unnamed_classes(labels: np.ndarray) -> tuple[str, ...]:
    """Class names '0'..'C-1' for a file that names none, C bounded by MAX_CLASSES."""
    top = int(labels.max()) if labels.size else -1
    if top >= MAX_CLASSES:
        raise TokenFileError(f"labels reach {top:,} but the file names no genres; name them (key "
                             f"'genres') or keep labels below {MAX_CLASSES:,}")
    return tuple(str(i) for i in range(top + 1))


def pack(sequences: list[np.ndarray], labels, ids, genres, split=None, metadata=None) -> TokenSet:
    """Variable-length (T_i, D) sequences -> a zero-padded TokenSet."""
    if not sequences:
        raise TokenFileError("no token sequences to pack")
    T, D = max(len(s) for s in sequences), sequences[0].shape[1]
    X = np.zeros((len(sequences), T, D), dtype=np.float32)
    for i, s in enumerate(sequences):
        X[i, :len(s)] = s
    N = len(sequences)
    return TokenSet(X, np.array([len(s) for s in sequences], dtype=np.int64),
                    np.asarray(labels, dtype=np.int64), np.asarray(ids, dtype=str), tuple(genres),
                    np.asarray(split if split is not None else [""] * N, dtype=str), metadata or {})


def convert_musicnn(folder: str | Path) -> TokenSet:
    """The musicnn GTZAN taggrams (training_*.npz / evaluation_*.npz: frames X (F, 50), Y, IDS)
    grouped by track into sequences; their own split becomes 'train' / 'test'."""

    folder = Path(folder)
    parts = {"train": sorted(folder.glob("training_*.npz")), "test": sorted(folder.glob("evaluation_*.npz"))}
    if not parts["train"] or not parts["test"]:
        raise TokenFileError(f"{folder} must hold training_*.npz and evaluation_*.npz musicnn files")
    seqs, labels, ids, split = [], [], [], []
    for name, files in parts.items():
        declared = sum(math.prod(shape) * dtype.itemsize for shape, dtype in array_headers(files[0]).values())
        if declared > MAX_BYTES:
            raise TokenFileError(f"{files[0]} declares {declared / 2**20:,.0f} MB of arrays, over "
                                 f"{MAX_BYTES / 2**20:,.0f} MB: not loaded")
        with np.load(files[0], allow_pickle=False) as d:
            X, Y, IDS = d["X"], d["Y"], d["IDS"].astype(str)
        starts = np.flatnonzero(np.r_[True, IDS[1:] != IDS[:-1]])
        for a, b in zip(starts, np.r_[starts[1:], len(IDS)]):
            genre = IDS[a].split("/")[0]
            if GENRES.index(genre) != int(Y[a]):
                raise TokenFileError(f"label {Y[a]} of {IDS[a]} contradicts its genre folder")
            seqs.append(X[a:b])
            labels.append(int(Y[a]))
            ids.append(IDS[a])
            split.append(name)
    return pack(seqs, labels, ids, GENRES, split,
                {"source": "musicnn MSD taggram (GTZAN, fault-filtered artist split)", "dim": 50,
                 "frontend_info": {"name": "musicnn", "token_dim": 50, "spacing_hops": 4,
                                   "spacing_s": 61 * 256 / 16000, "weights": "MSD_musicnn"}})
