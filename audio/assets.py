"""Where the shipped assets are: ``assets/`` beside the source tree (a checkout or an editable
install), else the copy a wheel installs under ``<prefix>/share/nystream/assets`` (pyproject's
data files), so that an installed `nystream` finds its weights and models from any directory."""
from __future__ import annotations

import sys
from pathlib import Path


def assets_dir() -> Path:
    beside = Path(__file__).resolve().parents[1] / "assets"
    if beside.is_dir():
        return beside
    return Path(sys.prefix) / "share" / "nystream" / "assets"
