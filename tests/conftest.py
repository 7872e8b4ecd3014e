import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SHARED = ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data():
    if not SHARED.is_dir():
        pytest.skip(f"shared data not found at {SHARED}")
    return SHARED
