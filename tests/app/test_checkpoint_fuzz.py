"""Every field of a real checkpoint, mutated (missing, wrong type, out of range, NaN): each load
either is refused with a one-line CheckpointError that names the file and the field, or - only
where the field is optional or its default is the saved value - gives the same model."""
import math

import pytest
import torch
from tiny import tiny_model

from app.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from models.landmarks import fit_fixed_landmarks

GENRES = [f"genre {i}" for i in range(10)]
NAN = float("nan")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_model("continual_nystrom", n=8, in_dim=50, landmarks=2, layers=2)
    fit_fixed_landmarks(model, torch.randn(3, 8, 50))               # fitted landmarks are weights too
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    save_checkpoint(model, path, classes=GENRES, metadata={"epochs": 3},
                    frontend={"name": "musicnn", "token_dim": 50, "spacing_hops": 4, "weights": "MSD"})
    return path, torch.load(path, weights_only=True)


def mutations(payload):
    """(field, kind, mutate(payload) in place) for every field of ``payload``."""
    out = []

    def at(field):
        *parents, leaf = field.split(".", 1) if field.startswith("state_dict.") else field.split(".")
        return parents, leaf

    def setter(field, value):
        def mutate(p):
            parents, leaf = at(field)
            d = p
            for k in parents:
                d = d[k]
            if value is KeyError:
                del d[leaf]
            else:
                d[leaf] = value(d[leaf]) if callable(value) else value
        return mutate

    fields = ["format", "version", "config", "classes", "frontend", "metadata", "state_dict"]
    fields += [f"config.{k}" for k in payload["config"]]
    fields += ["frontend.name", "frontend.token_dim", "frontend.spacing_hops"]
    keys = list(payload["state_dict"])
    fields += [f"state_dict.{k}" for k in (keys[0], keys[-1], next(k for k in keys if "fixed_q_land" in k))]
    for f in fields:
        out.append((f, "missing", setter(f, KeyError)))
        out.append((f, "wrong type", setter(f, lambda old: 3.5 if isinstance(old, str) else "x")))
        out.append((f, "NaN", setter(f, lambda old: old.clone().fill_(NAN) if isinstance(old, torch.Tensor)
                                      and old.is_floating_point() else NAN)))
        out.append((f, "out of range", setter(f, out_of_range)))
    return out


def out_of_range(old):
    if isinstance(old, bool):
        return 7
    if isinstance(old, int) or old is None:                      # pos_period None: T = n
        return 2 ** 40
    if isinstance(old, float):
        return -1.0
    if isinstance(old, str):
        return "nonsense"
    if isinstance(old, torch.Tensor):
        return torch.zeros(*old.shape, 3)                        # another shape
    if isinstance(old, list):
        return old[:-1]                                          # one class name short
    assert isinstance(old, dict), old
    return {"unexpected": 1}


def acceptable(field, kind):
    """Loads that must succeed: optional fields, free-form metadata, and another front-end name
    (models/ knows no front ends; the caller's ``frontend=`` check and the engine refuse it)."""
    optional = ("metadata", "frontend", "frontend.token_dim", "frontend.spacing_hops")
    return (kind == "missing" and field in optional) or (
        kind == "out of range" and field in ("metadata", "frontend.name"))


def test_every_mutated_field_is_refused_in_one_line_naming_file_and_field(saved, tmp_path):
    path, payload = saved
    model, _ = load_checkpoint(path)
    cases = mutations(payload)
    assert len(cases) == 4 * (7 + len(payload["config"]) + 3 + 3)
    refused = 0
    for field, kind, mutate in cases:
        p = torch.load(path, weights_only=True)
        mutate(p)
        bad = tmp_path / f"{field}-{kind}.pt".replace(" ", "_")
        torch.save(p, bad)
        try:
            loaded, _ = load_checkpoint(bad)
        except CheckpointError as e:
            msg = str(e)
            assert "\n" not in msg and str(bad) in msg, (field, kind, msg)
            leaf = field.split(".")[-1] if not field.startswith("state_dict.") else field
            assert leaf in msg or (field == "format" and "'format'" in msg), (field, kind, msg)
            refused += 1
            continue
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{field} {kind}: {type(e).__name__}: {e}")
        assert acceptable(field, kind), (field, kind, "loaded")
        assert loaded.cfg == model.cfg
        for a, b in zip(loaded.state_dict().values(), model.state_dict().values()):
            assert torch.equal(a, b)
    assert refused == sum(not acceptable(f, k) for f, k, _ in cases)


def test_a_checkpoint_is_never_written_with_non_finite_weights(tmp_path):
    model = tiny_model("continual", n=8, in_dim=50)
    with torch.no_grad():
        model.head.weight[0, 0] = math.inf
    with pytest.raises(CheckpointError, match="non-finite"):
        save_checkpoint(model, tmp_path / "m.pt", classes=GENRES)
    assert list(tmp_path.iterdir()) == []                        # nothing written, no temporary left


def test_huge_window_and_model_are_refused_before_anything_is_allocated(saved, tmp_path):
    path, _ = saved
    for key, value, words in (("window", 2 ** 40, "window must be in 1..8192"),
                              ("d_model", 2 ** 20, "over the limit of 50,000,000")):
        p = torch.load(path, weights_only=True)
        p["config"][key] = value
        if key == "d_model":
            p["config"]["heads"] = 1
        torch.save(p, tmp_path / "big.pt")
        with pytest.raises(CheckpointError, match=words):
            load_checkpoint(tmp_path / "big.pt")
