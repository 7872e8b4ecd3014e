"""VGGish weights: resolution order, verification, and the embedding itself (random weights)."""
import numpy as np
import pytest
import torch

from audio import vggish
from audio.errors import VGGishWeightsError
from audio.vggish import build_embedder, load_state_dict


def saved_weights(path, seed=3):
    """A real VGGish architecture's state dict, randomly initialised, saved like the hub file."""
    model = build_embedder(random_seed=seed).model
    torch.save(model.state_dict(), path)
    return model


def test_random_vggish_is_seeded_and_labelled():
    a, b = build_embedder(random_seed=1), build_embedder(random_seed=1)
    x = np.random.default_rng(0).standard_normal((3, 96, 64)).astype(np.float32)
    torch.testing.assert_close(a(x), b(x))
    assert a(x).shape == (3, 128)
    assert a.random and "RANDOM" in a.description
    with pytest.raises(ValueError, match="96, 64"):
        a(np.zeros((2, 90, 64)))


def test_explicit_weights_file_loads_and_embeds_like_its_model(tmp_path):
    model = saved_weights(tmp_path / "w.pth")
    e = build_embedder(tmp_path / "w.pth")
    x = np.random.default_rng(1).standard_normal((2, 96, 64)).astype(np.float32)
    torch.testing.assert_close(e(x), model(torch.as_tensor(x).unsqueeze(1)))
    assert not e.random and len(e.checksum) == 64


def test_resolution_order_env_then_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.delenv(vggish.ENV_VAR, raising=False)
    with pytest.raises(VGGishWeightsError, match="vggish-10086976.pth"):
        build_embedder(allow_download=False)
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    saved_weights(tmp_path / "hub" / "checkpoints" / vggish.WEIGHTS_FILE)
    assert "hub" in build_embedder(allow_download=False).description
    saved_weights(tmp_path / "env.pth")
    monkeypatch.setenv(vggish.ENV_VAR, str(tmp_path / "env.pth"))
    assert "env.pth" in build_embedder(allow_download=False).description


def test_offline_download_failure_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.delenv(vggish.ENV_VAR, raising=False)

    def offline(*a, **k):
        raise OSError("network unreachable")
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(VGGishWeightsError, match="download failed.*--random-vggish"):
        build_embedder()


def test_missing_and_wrong_weights_are_refused(tmp_path):
    with pytest.raises(VGGishWeightsError, match="not found"):
        load_state_dict(tmp_path / "none.pth")
    (tmp_path / "text.pth").write_text("hello")
    with pytest.raises(VGGishWeightsError, match="not a readable"):
        load_state_dict(tmp_path / "text.pth")
    torch.save({"features.0.weight": torch.zeros(3)}, tmp_path / "wrong.pth")
    with pytest.raises(VGGishWeightsError, match="not a VGGish state dict"):
        load_state_dict(tmp_path / "wrong.pth")
    state = build_embedder(random_seed=0).model.state_dict()
    state["embeddings.4.weight"] = torch.zeros(64, 4096)
    torch.save(state, tmp_path / "shape.pth")
    with pytest.raises(VGGishWeightsError, match="wrong shapes"):
        load_state_dict(tmp_path / "shape.pth")
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pth")
    with pytest.raises(VGGishWeightsError):
        load_state_dict(tmp_path / "module.pth")
