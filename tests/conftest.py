"""Shared test set-up. Tests live by area (models/, audio/, app/, gui/); helpers shared across
areas (audio_helpers, reference, tiny) live beside this file.

Markers, applied here so that they cannot be forgotten:
  shared   uses ../shared/data (skips cleanly when it is absent)
  jack     drives a real PortAudio input through a JACK dummy server
  display  opens a real X11 window under Xvfb
  gui      a Qt window (offscreen)
  slow     long property tests
`make test` runs everything; `make test-fast` deselects shared, jack, display, gui and slow.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(HERE))          # after ROOT: the packages app/, audio/, models/ win
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED = ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data():
    if not SHARED.is_dir():
        pytest.skip(f"shared data not found at {SHARED}")
    return SHARED


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if "shared_data" in getattr(item, "fixturenames", ()) or "shared_tokens" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.shared)
        if path.name == "test_microphone_jack.py":
            item.add_marker(pytest.mark.jack)
        if "xvfb" in item.name:
            item.add_marker(pytest.mark.display)
        if path.parent.name == "gui":
            item.add_marker(pytest.mark.gui)
