"""GTZAN: the ten genres in a fixed order, track discovery for the usual layouts, seeded splits;
and a user's own labelled audio, one sub-folder per class (``discover_folders``)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import AudioError

MAX_CLASSES = 1000           # classes a data set (and a token file) may name
MAX_CLASS_NAME = 64          # characters of a class name (a checkpoint holds the same)
GENRES = ("blues", "classical", "country", "disco", "hiphop", "jazz", "metal", "pop", "reggae",
          "rock")
_TRACK = re.compile(r"^(?P<genre>[a-z]+)\.(?P<num>\d{5})\.(au|wav)$")
LAYOUTS = ("genres/<genre>/<genre>.000NN.au|wav (original)",
           "genres_original/<genre>/<genre>.000NN.wav (Kaggle; also under Data/)",
           "<genre>/<genre>.000NN.au|wav or <genre>.000NN.au|wav directly in the folder")


class GTZANError(AudioError):
    """A GTZAN folder (or a folder of classes) that is missing, empty or in an unknown layout."""


@dataclass(frozen=True)
class Track:
    path: Path
    genre: str
    label: int
    track_id: str      # '<genre>/<file name>'


def discover(root: str | Path, ignored: list[Path] | None = None) -> list[Track]:
    """Every GTZAN track under ``root`` (sorted by genre, then number) for the layouts above.
    Entries named like a track that are not files (folders, broken links) are appended to
    ``ignored``, so that the caller can list them."""
    root = Path(root)
    if not root.is_dir():
        raise GTZANError(f"GTZAN folder not found: {root}")
    for base in (root / "genres", root / "genres_original", root / "Data" / "genres_original", root):
        genre_dirs = [base / g for g in GENRES if (base / g).is_dir()]
        files = [f for d in genre_dirs for f in d.iterdir()] if genre_dirs else \
            (list(base.iterdir()) if base == root else [])
        tracks = []
        for f in files:
            m = _TRACK.match(f.name)
            if m and m["genre"] in GENRES:
                if f.is_file():
                    tracks.append(Track(f, m["genre"], GENRES.index(m["genre"]), f"{m['genre']}/{f.name}"))
                elif ignored is not None:
                    ignored.append(f)
        if tracks:
            return sorted(tracks, key=lambda t: (t.label, t.path.name))
    if not any(root.iterdir()):
        raise GTZANError(f"GTZAN folder {root} is empty")
    raise GTZANError(f"no GTZAN tracks found in {root}; expected one of: " + "; ".join(LAYOUTS))


def discover_folders(root: str | Path) -> tuple[list[Track], tuple[str, ...]]:
    """A labelled data set laid out as one sub-folder per class, its name the class's: every audio
    file under each (recursively, by name: audio/decoding.py ``is_audio_name``), sorted by class
    then path; the classes in name order. GTZANError for fewer than 2 classes with files, more
    than MAX_CLASSES, or a class name a checkpoint cannot hold."""
    from .decoding import audio_files_under
    from .errors import printable
    root = Path(root)
    if not root.is_dir():
        raise GTZANError(f"folder of classes not found: {root}")
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    found = {d.name: audio_files_under(d)[0] for d in folders}
    classes = tuple(name for name, files in found.items() if files)
    if len(classes) < 2:
        raise GTZANError(f"{root} needs two or more sub-folders of audio files, one per class; "
                         f"found {len(classes)} ({', '.join(map(printable, classes)) or 'none'})")
    if len(classes) > MAX_CLASSES:
        raise GTZANError(f"{root} has {len(classes):,} classes; at most {MAX_CLASSES:,}")
    for name in classes:
        if len(name) > MAX_CLASS_NAME or not name.isprintable() or not name.strip():
            raise GTZANError(f"class folder {printable(name)!r}: a class name is printable, not blank, "
                             f"at most {MAX_CLASS_NAME} characters")
    tracks = [Track(p, name, label, f"{name}/{p.relative_to(root / name).as_posix()}")
              for label, name in enumerate(classes) for p in found[name]]
    return tracks, classes


def stratified_split(labels, seed: int, fractions=(0.72, 0.18, 0.10)) -> dict[str, np.ndarray]:
    """Seeded stratified split into train/val/test index arrays (the paper's 72/18/10 default)."""
    labels = np.asarray(labels)
    if abs(sum(fractions) - 1.0) > 1e-9 or len(fractions) != 3:
        raise ValueError(f"fractions must be three numbers summing to 1, got {fractions}")
    rng = np.random.default_rng(seed)
    parts = {"train": [], "val": [], "test": []}
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_val = int(round(fractions[1] * len(idx)))
        n_test = int(round(fractions[2] * len(idx)))
        parts["test"] += list(idx[:n_test])
        parts["val"] += list(idx[n_test:n_test + n_val])
        parts["train"] += list(idx[n_test + n_val:])
    return {k: np.sort(np.array(v, dtype=np.int64)) for k, v in parts.items()}
