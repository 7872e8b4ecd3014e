"""Training (two-phase fixed landmarks included) and the evaluation report, end to end."""
import json

import numpy as np
import pytest
import torch
from audio_helpers import first_seconds
from tiny import TINY

from app.cli import main
from app.offline.evaluate import EvaluateError, evaluate
from app.offline.train import MIN_PER_GENRE, TrainError, make_splits, train
from audio.gtzan import GENRES
from audio.tokens.cache import TokenSet, convert_musicnn, load_tokens, pack, save_tokens
from app.checkpoint import load_checkpoint, save_checkpoint
from app.offline.training import TrainConfig, batch_predict
from error_model import model_scores, relative_tol

STAGES = 6      # float32 stages in a block: embedding, q/k/v projection, scores, softmax sums, output
                # projection, feed-forward (tests/error_model.py)
from models.transformer import ModelConfig



def synthetic_tokens(n_per_class=12, T=10, D=8, classes=3, seed=0, lengths=(9, 10)) -> TokenSet:
    """Separable sequences: class c has mean +2 on feature c, variable lengths."""
    g = np.random.default_rng(seed)
    seqs, labels = [], []
    for c in range(classes):
        for i in range(n_per_class):
            x = g.normal(size=(lengths[i % len(lengths)], D)).astype(np.float32)
            x[:, c] += 2.0
            seqs.append(x)
            labels.append(c)
    return pack(seqs, labels, [f"t{i}" for i in range(len(seqs))], GENRES[:classes])


def tiny_config(tokens, **kw):
    return ModelConfig(**{**dict(variant="continual", in_dim=tokens.X.shape[2], window=tokens.X.shape[1],
                                 num_landmarks=2, num_classes=len(tokens.genres)), **TINY, "dropout": 0.0, **kw})


def test_splits_predefined_and_random():
    tokens = synthetic_tokens()
    parts = make_splits(tokens, 0)
    all_idx = np.concatenate(list(parts.values()))
    assert sorted(all_idx) == list(range(len(tokens.labels)))          # disjoint and complete
    assert all(len(set(tokens.labels[v])) == 3 for v in parts.values())  # stratified
    tokens.split = np.array(["test" if i % 4 == 0 else "train" for i in range(len(tokens.labels))])
    parts = make_splits(tokens, 1)
    np.testing.assert_array_equal(parts["test"], np.arange(0, len(tokens.labels), 4))
    assert set(parts["val"]).isdisjoint(parts["train"]) and len(parts["val"]) > 0
    assert not set(parts["val"]) & set(parts["test"])
    tokens.split = np.array(["train"] * len(tokens.labels))
    with pytest.raises(TrainError, match="'train' and 'test'"):
        make_splits(tokens, 0)
    # the smallest genre size the error message names is enough, one fewer is not
    assert min(len(v) for v in make_splits(synthetic_tokens(n_per_class=MIN_PER_GENRE), 0).values()) > 0
    with pytest.raises(TrainError, match=f"at least {MIN_PER_GENRE} sequences of one genre"):
        make_splits(synthetic_tokens(n_per_class=MIN_PER_GENRE - 1), 0)


def test_fixed_training_runs_both_phases_and_keeps_landmarks_frozen(tmp_path, monkeypatch):
    import app.offline.training as T
    tokens = synthetic_tokens()
    cfg = tiny_config(tokens, variant="continual_nystrom", landmark_mode="fixed", layers=2)
    fitted, real = [], T.fit_fixed_landmarks

    def fit(model, seqs, **kw):   # the real k-means fit; remember its landmarks before phase 2
        real(model, seqs, **kw)
        fitted.extend(b.attn.fixed_q_land.clone() for b in model.blocks)
    monkeypatch.setattr(T, "fit_fixed_landmarks", fit)
    model, meta = train(tokens, cfg, TrainConfig(lr=3e-3, epochs=4, patience=10, batch_size=8),
                        log=lambda s: None)
    phases = [h["phase"] for h in meta["history"]]
    assert phases == ["phase 1"] * 4 + ["phase 2"] * 4
    assert model.cfg.landmark_mode == "fixed"
    assert len(fitted) == 2
    for b, q in zip(model.blocks, fitted):
        assert bool(b.attn.has_fixed)
        torch.testing.assert_close(b.attn.fixed_q_land, q, rtol=0, atol=0)   # frozen in phase 2
    assert meta["metrics"]["test_acc"] >= 0.9                             # separable data
    save_checkpoint(model, tmp_path / "f.pt", classes=list(tokens.genres), metadata=meta)
    loaded, payload = load_checkpoint(tmp_path / "f.pt", variant="continual_nystrom")
    assert loaded.cfg.landmark_mode == "fixed" and payload["metadata"]["split"]["test"]
    x = torch.as_tensor(tokens.X[:3])
    torch.testing.assert_close(loaded(x), model.eval()(x))


def test_random_start_index_is_used_in_training(monkeypatch):
    tokens = synthetic_tokens()
    cfg = tiny_config(tokens, pos_period=25)
    seen = []
    from models.transformer import RecyclingPositionalEncoding
    real = RecyclingPositionalEncoding.forward

    def forward(self, x, start=0):
        seen.append(start)
        return real(self, x, start)
    monkeypatch.setattr(RecyclingPositionalEncoding, "forward", forward)
    train(tokens, cfg, TrainConfig(lr=1e-3, epochs=1, batch_size=8), log=lambda s: None)
    starts = torch.cat([s for s in seen if isinstance(s, torch.Tensor)])
    assert starts.min() >= 0 and starts.max() < 25 and len(set(starts.tolist())) > 5
    assert all(s == 0 for s in seen if not isinstance(s, torch.Tensor))   # evaluation: start 0


def test_train_and_evaluate_cli_refuse_bad_input(tmp_path, capsys):
    tokens = synthetic_tokens()
    save_tokens(tmp_path / "t.npz", tokens)
    tiny = ["--d-model", "32", "--heads", "4", "--ff-dim", "64", "--epochs", "1", "--landmarks", "2"]
    assert main(["train", "--tokens", str(tmp_path / "t.npz"), "--variant", "continual",
                 "--out", str(tmp_path / "c.pt"), *tiny]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("training continual, 1 block, window n = 10, d = 32, 4 heads, on t.npz: "
                          "36 sequences of up to 10 8-d tokens, 3 genres; split train 27, val 6, test 3")
    result = json.loads(out)                                 # rounded: no 0.10000000149011612
    assert all(len(repr(result[k]).split(".")[-1]) <= 4 for k in ("val_acc", "test_acc"))
    # too few sequences for the random split: says how many it needs
    save_tokens(tmp_path / "few.npz", synthetic_tokens(n_per_class=5))
    assert main(["train", "--tokens", str(tmp_path / "few.npz"), "--out", str(tmp_path / "x.pt"), *tiny]) == 1
    err = capsys.readouterr().err
    assert "15 sequences are too few" in err and "at least 6 sequences of one genre" in err
    assert "the largest genre here has 5" in err
    # wrong shape: X without a time axis
    np.savez(tmp_path / "flat.npz", X=np.zeros((4, 8), np.float32), labels=np.zeros(4, np.int64))
    assert main(["train", "--tokens", str(tmp_path / "flat.npz"), "--out", str(tmp_path / "x.pt")]) == 1
    assert "(N, T, D)" in capsys.readouterr().err
    np.savez(tmp_path / "nolabels.npz", X=np.zeros((4, 3, 8), np.float32))
    assert main(["train", "--tokens", str(tmp_path / "nolabels.npz"), "--out", str(tmp_path / "x.pt")]) == 1
    assert "no labels" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()
    # a checkpoint of another variant
    assert main(["train", "--tokens", str(tmp_path / "t.npz"), "--variant", "continual_nystrom",
                 "--landmark-mode", "fixed", "--init", str(tmp_path / "c.pt"), "--out", str(tmp_path / "x.pt")]) == 1
    assert "holds a 'continual' model, not 'continual_nystrom'" in capsys.readouterr().err
    assert main(["evaluate", "--tokens", str(tmp_path / "t.npz"), "--checkpoint", str(tmp_path / "c.pt"),
                 "--variant", "regular", "--report", str(tmp_path / "r")]) == 1
    assert "not 'regular'" in capsys.readouterr().err
    # tokens of another dimension
    other = synthetic_tokens(D=5)
    save_tokens(tmp_path / "d5.npz", other)
    assert main(["evaluate", "--tokens", str(tmp_path / "d5.npz"), "--checkpoint", str(tmp_path / "c.pt"),
                 "--report", str(tmp_path / "r")]) == 1
    assert "expects 8-d tokens, these are 5-d" in capsys.readouterr().err
    # the same shape, but another token file than the one it was trained on
    save_tokens(tmp_path / "t2.npz", synthetic_tokens(seed=1))
    with pytest.raises(EvaluateError, match="trained on another token file"):
        evaluate(str(tmp_path / "t2.npz"), [str(tmp_path / "c.pt")], log=lambda s: None)
    # a window shorter than the sequences: trained on crops that fit it, scored on each
    # sequence's last window (what a stream sees at its end)
    assert main(["train", "--tokens", str(tmp_path / "t.npz"), "--window", "4", "--variant", "continual",
                 "--out", str(tmp_path / "x.pt"), *tiny]) == 0
    assert "window n = 4" in capsys.readouterr().err
    short = load_checkpoint(tmp_path / "x.pt")[0].eval()
    x = torch.as_tensor(tokens.X[:1, :int(tokens.lengths[0])])
    short.reset(1)
    for t in range(x.shape[1]):
        streamed = short.step(x[:, t])
    L = x.shape[1]
    got = batch_predict(short, x, np.array([L]), np.array([0]))       # the last window at its positions
    score = model_scores(short.double(), x[:, L - 4:].double(), L - 4)
    tol = 2 * relative_tol(score, 4, STAGES) * max(1.0, streamed.abs().max().item())   # two float32 paths
    assert (got - streamed).abs().max().item() <= tol


def test_end_to_end_on_gtzan_excerpts(shared_data, tmp_path, capsys):
    """extract (random VGGish) -> train tiny models -> evaluate -> a consistent report, on the
    first 6 s of 18 real excerpts."""
    folder = tmp_path / "gtzan"
    folder.mkdir()
    for g in ("classical", "metal", "pop"):
        for k in range(6):
            first_seconds(shared_data / "gtzan_excerpts" / f"{g}.{k:05d}.wav", folder, 6)
    tok = tmp_path / "tokens.npz"
    capsys.readouterr()
    assert main(["extract", "--gtzan", str(folder), "--random-vggish", "--out", str(tok)]) == 0
    final = capsys.readouterr().err.strip().splitlines()[-1]
    assert final.startswith(f"wrote {tok}") and "RANDOM VGGish" in final and "NOT meaningful" in final
    tokens = load_tokens(tok)
    assert tokens.X.shape[0] == 18 and tokens.X.shape[2] == 128
    tiny = ["--d-model", "32", "--heads", "4", "--ff-dim", "64", "--epochs", "2", "--landmarks", "4",
            "--lr", "1e-3"]
    ckpts = []
    for variant, extra in (("regular", []), ("continual", ["--layers", "2"]),
                           ("continual_nystrom", []), ("continual_nystrom", ["--landmark-mode", "fixed"])):
        out = tmp_path / f"{variant}{len(ckpts)}.pt"
        assert main(["train", "--tokens", str(tok), "--variant", variant, *extra, *tiny, "--out", str(out)]) == 0
        ckpts += ["--checkpoint", str(out)]
    capsys.readouterr()
    assert main(["evaluate", "--tokens", str(tok), *ckpts, "--report", str(tmp_path / "report")]) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    for name in ("report.md", "accuracy_vs_time.png", "flops_per_step.png", "confusion.png", "per_class.png"):
        assert (tmp_path / "report" / name).stat().st_size > 500
    assert len(report["models"]) == 4
    md = (tmp_path / "report" / "report.md").read_text()
    assert "**RANDOM front end" in md.split("## Results")[0]          # said before any number
    for m in report["models"]:
        s, (ck,) = m["summary"], m["checkpoints"]
        assert s["name"] in md
        assert ck["test_size"] == 3 and np.sum(ck["confusion"]) == 3        # one test track per genre
        assert s["accuracy_mean"] == pytest.approx(np.trace(ck["confusion"]) / 3)
        assert s["agreement_min"] == 1.0                                    # exact at window = length
        assert len(m["costs"]["sda_flops"]) == 3 * m["config"]["window"]
    regular = next(m["summary"] for m in report["models"] if m["summary"]["key"] == "regular")
    fixed = next(m["summary"] for m in report["models"] if m["summary"]["key"] == "continual_nystrom/fixed")
    assert regular["relative_sda_flops"] == 1.0 and fixed["relative_sda_flops"] < 0.05
    assert "| continual_nystrom/fixed | 6k |" in md


@pytest.fixture
def musicnn(shared_data, tmp_path):
    path = tmp_path / "musicnn.npz"
    save_tokens(path, convert_musicnn(shared_data / "gtzan_musicnn_tokens"))
    return path


@pytest.mark.parametrize("variant", ["continual", "continual_nystrom"])
def test_learning_on_musicnn_tokens(musicnn, tmp_path, variant):
    """A short run reaches well above chance (10 %) on the real test split, streamed."""
    tokens = load_tokens(musicnn)
    cfg = ModelConfig(variant=variant, in_dim=50, window=29, d_model=64, heads=4, ff_dim=128,
                      num_landmarks=4, num_classes=10)
    model, meta = train(tokens, cfg, TrainConfig(lr=1e-3, epochs=12, patience=5, batch_size=32),
                        log=lambda s: None)
    save_checkpoint(model, tmp_path / "m.pt", classes=list(tokens.genres), metadata=meta)
    report = evaluate(str(musicnn), [str(tmp_path / "m.pt")], log=lambda s: None)
    s = report["models"][0]["summary"]
    assert report["models"][0]["checkpoints"][0]["test_size"] == 290
    assert s["accuracy_mean"] >= 0.5, s["accuracy_mean"]
    assert s["agreement_min"] == 1.0
