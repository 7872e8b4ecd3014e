"""Data that contradicts itself is refused the same way by train and evaluate, train never writes
a checkpoint the loaders refuse, a genre without data is said (never 0 %), and an output that
cannot be written is said before the work starts (a read-only folder, a name too long, a full disk)."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

from app.cli import main
from audio.gtzan import GENRES
from audio.tokens.cache import pack, save_tokens
from app.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from test_train_evaluate import synthetic_tokens
from tiny import tiny_model

TINY = ["--d-model", "32", "--heads", "4", "--ff-dim", "64", "--epochs", "1", "--landmarks", "2"]


def raw_token_file(path, tokens, **replace):
    """A token file written key by key (no TokenSet checks), some keys replaced."""
    arrays = {"X": tokens.X, "lengths": tokens.lengths, "labels": tokens.labels, "ids": tokens.ids,
              "genres": np.array(tokens.genres), "split": tokens.split,
              "metadata": np.array(json.dumps(tokens.metadata))}
    np.savez(path, **{**arrays, **replace})
    return path


def train_and_evaluate_errors(tmp_path, tokens_path, capsys) -> tuple[str, str]:
    """The error lines of `train` and of `evaluate` on ``tokens_path`` (each must exit 1)."""
    good = tmp_path / "good.npz"
    save_tokens(good, synthetic_tokens())
    ckpt = tmp_path / "good.pt"
    if not ckpt.exists():
        assert main(["train", "--tokens", str(good), "--variant", "continual", "--out", str(ckpt), *TINY]) == 0
    capsys.readouterr()
    assert main(["train", "--tokens", str(tokens_path), "--out", str(tmp_path / "x.pt"), *TINY]) == 1
    train_err = capsys.readouterr().err.strip().splitlines()
    assert main(["evaluate", "--tokens", str(tokens_path), "--checkpoint", str(ckpt),
                 "--report", str(tmp_path / "r")]) == 1
    evaluate_err = capsys.readouterr().err.strip().splitlines()
    assert len(train_err) == 1 and len(evaluate_err) == 1, (train_err, evaluate_err)
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "r" / "report.md").exists()
    return train_err[0], evaluate_err[0]


@pytest.mark.parametrize("metadata, says", [
    ({"frontend_info": {"name": "musicnn", "token_dim": 50, "spacing_hops": 4}},
     "metadata.frontend_info.token_dim (musicnn) says 50-d tokens, X holds 8-d tokens"),
    ({"dim": 128}, "metadata.dim says 128-d tokens, X holds 8-d tokens"),
    ({"frontend_info": {"name": "vggish", "token_dim": 8, "spacing_hops": 0}},
     "spacing_hops must be a positive integer, got 0"),
])
def test_metadata_that_contradicts_the_arrays_is_one_line_in_train_and_evaluate(tmp_path, capsys, metadata, says):
    tokens = synthetic_tokens()
    path = raw_token_file(tmp_path / "t.npz", tokens, metadata=np.array(json.dumps(metadata)))
    train, evaluate = train_and_evaluate_errors(tmp_path, path, capsys)
    assert train == evaluate and train.startswith(f"error: {path}: ") and says in train, train


@pytest.mark.parametrize("genres, says", [
    (["blues", "blues\udcff", "country"], r"genres[1] is not valid UTF-8: 'blues\udcff'"),
    (["blues", "blues", "country"], "genres names 'blues' twice"),
    (["blues", " ", "country"], "genres[1] is empty"),
])
def test_class_names_that_cannot_print_or_repeat_are_refused(tmp_path, capsys, genres, says):
    path = raw_token_file(tmp_path / "t.npz", synthetic_tokens(), genres=np.array(genres))
    train, evaluate = train_and_evaluate_errors(tmp_path, path, capsys)
    assert train == evaluate and says in train, train


def test_a_checkpoint_the_loaders_would_refuse_is_never_written(tmp_path):
    model = tiny_model("continual", n=8, in_dim=8)
    path = tmp_path / "m.pt"
    for classes in (["a", "a"] + [str(i) for i in range(model.cfg.num_classes - 2)],
                    ["a\udcff"] + [str(i) for i in range(model.cfg.num_classes - 1)]):
        with pytest.raises(CheckpointError, match="not saving: .*field 'classes'"):
            save_checkpoint(model, path, classes=classes)
        assert os.listdir(tmp_path) == []                   # neither the file nor its temporary
    save_checkpoint(model, path, classes=[str(i) for i in range(model.cfg.num_classes)])
    loaded, _ = load_checkpoint(path)
    x = torch.randn(1, 8, 8)
    torch.testing.assert_close(loaded(x), model.eval()(x), rtol=0, atol=0)


def test_a_genre_without_data_is_said_in_training_and_has_no_accuracy_in_the_report(tmp_path, capsys):
    """Three genres; 'disco' appears in the test split only, 'country' has no test sequence."""
    base = synthetic_tokens(n_per_class=12, classes=3)      # blues, classical, country
    keep = [i for i, y in enumerate(base.labels) if not (y == 2 and i % 12 >= 9)]   # country: train only
    seqs = [base.X[i, :base.lengths[i]] for i in keep]
    labels, split = base.labels[keep].tolist(), ["test" if i % 12 >= 9 else "train" for i in keep]
    seqs += [np.full((10, 8), 3.0, np.float32)] * 3         # disco: three test sequences, no training ones
    labels += [3] * 3
    split += ["test"] * 3
    tokens = pack(seqs, labels, [f"t{i}" for i in range(len(seqs))], GENRES[:4], split)
    save_tokens(tmp_path / "t.npz", tokens)
    assert main(["train", "--tokens", str(tmp_path / "t.npz"), "--variant", "continual",
                 "--out", str(tmp_path / "m.pt"), *TINY]) == 0
    err = capsys.readouterr().err
    assert "note: the training split holds no sequence of disco: the model will not learn to predict it" in err
    assert main(["evaluate", "--tokens", str(tmp_path / "t.npz"), "--checkpoint", str(tmp_path / "m.pt"),
                 "--report", str(tmp_path / "r")]) == 0
    report = (tmp_path / "r" / "report.md").read_text()
    header = next(x for x in report.splitlines() if x.startswith("| model | blues"))
    row = report.splitlines()[report.splitlines().index(header) + 2]
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert header.split("|")[2:6] == [" blues ", " classical ", " country ", " disco "]
    assert cells[2] == "—" and cells[3] != "—"             # country: no test data; disco: 0 % is real
    assert "no sequence of this genre (no accuracy, not 0 %)" in report
    summary = json.loads((tmp_path / "r" / "report.json").read_text())["models"][0]["summary"]
    assert summary["per_class"][2] is None                   # standard JSON: null, not 0 and not NaN


def test_an_output_that_cannot_be_made_is_a_usage_error_before_any_work(tmp_path, capsys):
    save_tokens(tmp_path / "t.npz", synthetic_tokens())
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        for out, says in ((ro / "m.pt", "cannot be written: read-only file system"),
                          (tmp_path / ("m" * 260 + ".pt"), "cannot be written: file name too long")):
            with pytest.raises(SystemExit) as e:
                main(["train", "--tokens", str(tmp_path / "t.npz"), "--out", str(out), *TINY])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"argument --out: {out} {says}" in err, err
            assert "training" not in err
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def test_train_onto_a_full_disk_is_refused_before_training(tmp_path, small_disk, capsys):
    mount, fill = small_disk
    save_tokens(tmp_path / "t.npz", synthetic_tokens())
    fill(0)
    assert main(["train", "--tokens", str(tmp_path / "t.npz"), "--out", str(mount / "m.pt"), *TINY]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no space left on the device: {mount / 'm.pt'} "
                                               "(the checkpoint needs about "), err
    assert not (mount / "m.pt").exists()
