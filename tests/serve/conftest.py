"""What the serve tests share: tiny trained checkpoints on the musicnn front end (two models,
1 and 2 blocks) and two short 16 kHz files."""
import numpy as np
import pytest

from audio.frontends import build_frontend, frontend_metadata
from audio.gtzan import GENRES
from audio_helpers import tone, write
from app.checkpoint import save_checkpoint
from tiny import tiny_model

MODELS = [("continual", 1, 1), ("continual_nystrom", 2, 2)]


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    fe = build_frontend("musicnn")
    checkpoints = []
    for i, (variant, layers, seed) in enumerate(MODELS):
        model = tiny_model(variant, n=8, in_dim=50, layers=layers, seed=seed)
        save_checkpoint(model, d / f"m{i}.pt", classes=list(GENRES), frontend=frontend_metadata(fe))
        checkpoints.append(str(d / f"m{i}.pt"))
    songs = {"a": write(d / "a.wav", tone(3.0, 16000, 330.0), 16000),
             "b": write(d / "b.wav", np.concatenate([tone(1.0, 16000, f) for f in (220, 440)]), 16000)}
    return checkpoints, songs


