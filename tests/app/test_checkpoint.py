"""Checkpoints round-trip (weights, config, fixed landmarks) and refuse the wrong model."""
import pytest
import torch
from tiny import tiny_config

from app.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from models.landmarks import fit_fixed_landmarks
from models.transformer import build_model

CLASSES = [f"c{i}" for i in range(10)]


small = tiny_config


def test_round_trip_with_fixed_landmarks(tmp_path):
    torch.manual_seed(0)
    model = build_model(small(variant="continual_nystrom", layers=2)).eval()
    fit_fixed_landmarks(model, torch.randn(20, 12, 16))
    save_checkpoint(model, tmp_path / "m.pt", classes=CLASSES, metadata={"seed": 0, "acc": 0.5})
    loaded, payload = load_checkpoint(tmp_path / "m.pt", variant="continual_nystrom", in_dim=16,
                                      classes=CLASSES)
    assert payload["metadata"] == {"seed": 0, "acc": 0.5}
    assert loaded.cfg.landmark_mode == "fixed"
    x = torch.randn(1, 20, 16)
    model.reset(1)
    loaded.reset(1)
    for t in range(20):
        torch.testing.assert_close(loaded.step(x[:, t]), model.step(x[:, t]))


@pytest.mark.parametrize("kw,match", [
    (dict(variant="continual"), "holds a 'regular' model"),
    (dict(in_dim=128), "expects 16-d tokens"),
    (dict(classes=["a", "b"]), "trained for classes"),
])
def test_mismatching_checkpoints_are_refused(tmp_path, kw, match):
    save_checkpoint(build_model(small(variant="regular")), tmp_path / "r.pt", classes=CLASSES)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path / "r.pt", **kw)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "none.pt")
    (tmp_path / "junk.pt").write_bytes(b"\x00junk")
    with pytest.raises(CheckpointError, match="not a readable"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a Nystream checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
