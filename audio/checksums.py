"""sha256 of files: weight caches, token files and the data a checkpoint was trained on."""
from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(*paths: str | Path) -> str:
    """Hex sha256 of the concatenated contents of ``paths``, read in 1 MiB blocks."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
