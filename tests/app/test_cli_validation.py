"""Arguments are validated at parse time (a usage error naming the option, exit 2, before any
work), bad checkpoints are one-line errors in every command that loads them, and no output is
ever non-finite: a model that answers NaN stops the run, JSON is standard JSON."""
import json
import math

import numpy as np
import pytest
import torch
from tiny import tiny_model

from app.cli import build_parser
from cli_helpers import run_command
from engine_helpers import engine_of
from audio.frontends import build_frontend
from audio.sources import DemoSource
from audio.tokens.cache import pack, save_tokens
from app.checkpoint import save_checkpoint


@pytest.mark.parametrize("argv,words", [
    (["classify", "--demo", "--window", "0"], "argument --window: 0 is out of range: give 1..8192"),
    (["classify", "--demo", "--landmarks", "0"], "argument --landmarks: 0 is out of range: give 1 or more"),
    (["classify", "--demo", "--seconds", "nan"], "argument --seconds: nan is not a finite number"),
    (["classify", "--demo", "--seconds", "-5"], "argument --seconds: -5 must be more than 0"),
    (["classify", "--demo", "--csv", "/nonexistent_dir/x.csv"],
     "argument --csv: folder /nonexistent_dir does not exist"),
    (["classify", "--demo", "--csv", "/proc/x.csv"],
     "argument --csv: /proc/x.csv cannot be written: folder /proc takes no new files"),
    (["train", "--tokens", "t.npz", "--out", "m.pt", "--lr", "inf"], "argument --lr: inf is not a finite number"),
    (["train", "--tokens", "t.npz", "--out", "m.pt", "--dropout", "1"], "argument --dropout: 1 is out of range"),
    (["train", "--tokens", "t.npz", "--out", "/nonexistent_dir/m.pt"], "argument --out: folder /nonexistent_dir"),
    (["bench", "--windows", "30,x"], "argument --windows: 'x' is not an integer"),
    (["bench", "--soak", "-1"], "argument --soak: -1 must be more than 0"),
    (["gui", "--quit-after", "inf"], "argument --quit-after: inf is not a finite number"),
    (["extract", "--out", "/", "--gtzan", "g"], "argument --out: / is a folder, not a file name"),
])
def test_bad_arguments_are_usage_errors_at_parse_time(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize("argv,words", [
    (["classify", "--demo", "2", "--precision", "tf32"], "classify: --precision tf32 is for --device cuda (the CPU has no TF32)"),
    (["serve", "--precision", "tf32"], "serve: --precision tf32 is for --device cuda (the CPU has no TF32)"),
    (["bench", "--streams", "--precision", "tf32"], "bench: --precision tf32 is for --device cuda (the CPU has no TF32)"),
    (["classify", "--demo", "2", "--precision", "bf16", "--recompute-frontend"],
     "classify: --precision bf16 is for the continual front end (the recomputed network is the float32 reference)"),
    (["classify", "--demo", "2", "--precision", "bf16", "--frontend", "vggish"],
     "classify: --precision bf16 is for the musicnn front end (VGGish runs float32)"),
    (["classify", "--demo", "2", "--precision", "bf16", "--random-vggish"],
     "classify: --precision bf16 is for the musicnn front end (VGGish runs float32)"),
    (["bench", "--streams", "--models", "continual,bogus"],
     "error: --models: no shipped model bogus; shipped: regular, continual, nystrom, continual_nystrom"),
])
def test_precisions_this_run_cannot_have_and_unknown_models_are_one_line_errors_before_any_work(argv, words):
    r = run_command(*argv)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith(words), r.stderr
    assert "Traceback" not in r.stderr and "compiled" not in r.stderr      # nothing prepared first


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
@pytest.mark.parametrize("argv", [["classify", "--demo", "--seconds", "1"], ["extract", "--gtzan", ".", "--out", "t.npz"],
                                  ["serve"], ["train", "--tokens", "t.npz", "--out", "m.pt"], ["bench", "--streams"]])
def test_cuda_asked_for_without_cuda_is_a_one_line_error_never_a_cpu_run(argv, tmp_path, monkeypatch):
    from app.cli import main
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([*argv, "--device", "cuda"])
    assert str(e.value).startswith(f"{argv[0]}: --device cuda: no CUDA device here (torch {torch.__version__}")


def test_good_arguments_parse_to_checked_values(tmp_path):
    args = build_parser().parse_args(["classify", "--demo", "--seconds", "2.5", "--window", "29",
                                      "--csv", str(tmp_path / "x.csv")])
    assert (args.seconds, args.window, args.csv) == (2.5, 29, str(tmp_path / "x.csv"))
    assert build_parser().parse_args(["bench", "--windows", "30, 120"]).windows == (30, 120)


def test_a_broken_checkpoint_is_one_line_in_classify_evaluate_and_train(tmp_path):
    model = tiny_model("continual", n=8, in_dim=50)
    save_checkpoint(model, tmp_path / "ok.pt", classes=[f"g{i}" for i in range(10)])
    payload = torch.load(tmp_path / "ok.pt", weights_only=True)
    payload["config"]["heads"] = 0
    torch.save(payload, tmp_path / "bad.pt")
    tokens = tmp_path / "t.npz"
    save_tokens(tokens, pack([np.ones((8, 50))] * 60, [i % 10 for i in range(60)], [str(i) for i in range(60)],
                             [f"g{i}" for i in range(10)]))
    runs = [["classify", "--demo", "--seconds", "1", "--checkpoint", str(tmp_path / "bad.pt")],
            ["train", "--tokens", str(tokens), "--out", str(tmp_path / "m.pt"), "--init", str(tmp_path / "bad.pt")],
            ["evaluate", "--tokens", str(tokens), "--checkpoint", str(tmp_path / "bad.pt"), "--report",
             str(tmp_path / "report")]]
    for argv in runs:
        out = run_command(*argv)                 # an exception other than the one-line error would raise here
        assert out.returncode == 1, out.stderr[-800:]
        line = [x for x in out.stderr.splitlines() if x.startswith("error:")]
        assert len(line) == 1 and "bad.pt: field 'config' is invalid: heads must be >= 1" in line[0], \
            out.stderr[-800:]


def test_a_model_that_answers_nan_stops_its_stream():
    model = tiny_model("continual", n=8, in_dim=50)
    with torch.no_grad():
        model.head.bias[3] = math.nan
    engine = engine_of(build_frontend("musicnn"), {"broken": model})
    assert list(engine.run([DemoSource(seconds=2)])) == []                 # no record with a NaN in it
    assert [why for _, why in engine.errors] == ["broken answered non-finite probabilities at hop 0; "
                                                 "this stream stopped"]


def test_json_lines_are_standard_json():
    engine = engine_of(build_frontend("musicnn"), {"continual": tiny_model("continual", n=8, in_dim=50)})
    r = next(iter(engine.run([DemoSource(seconds=1)])))

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    assert json.loads(r.to_json(), parse_constant=refuse)["step"] == 0
    r.models["continual"].latency_ms = math.nan
    with pytest.raises(ValueError):
        r.to_json()
