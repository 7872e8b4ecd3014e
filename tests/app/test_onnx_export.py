"""The exported streaming step (`main.py export`, app/offline/onnx_export.py) run by ONNX Runtime equals
the torch step: ten windows of steps of the shipped trained models on real musicnn tokens and on a
stream whose scale swings 20x (2-block models with seeded weights: the swinging stream), each
step against the float64 model with the suite's error model (tests/error_model.py); the events it reports are the torch step's; the docs' example runs
without torch; `classify --onnx` runs it beside the others."""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from app.cli import main
from app.runtime.onnx_step import OnnxModelError, OnnxStep
from app.checkpoint import load_checkpoint
from error_model import model_scores, relative_tol

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "assets" / "models"
WINDOWS = 10            # steps of each stream, in windows (290 steps for the shipped models' n = 29):
                        # warm-up, then every event recurs many times
STAGES = 6      # float32 stages chained in a block (as tests/models/test_fused.py): embedding,
                # q/k/v projection, scores, softmax sums, output projection, feed-forward


EXPORTED: dict[Path, tuple[Path, dict]] = {}    # a shipped checkpoint's export, made once per worker (the exporter takes 10-30 s)


def export(checkpoint: Path, out: Path, capsys) -> dict:
    """``main.py export`` of ``checkpoint`` to ``out``; a shipped checkpoint's file and report are
    the first export's (a module's tests run in one worker: ``--dist loadfile``)."""
    if checkpoint in EXPORTED:
        first, report = EXPORTED[checkpoint]
        shutil.copy(first, out)
        return report
    assert main(["export", "--checkpoint", str(checkpoint), "--onnx", str(out), "--check-steps", "50"]) == 0
    report = json.loads(capsys.readouterr().out)
    if checkpoint.parent == MODELS:
        EXPORTED[checkpoint] = (out, report)
    return report


def swinging_stream(steps: int, dim: int, seed: int, n: int) -> torch.Tensor:
    """(steps, 1, dim) tokens of the musicnn taggrams' scale (0..1), their scale swinging between
    1x and 20x in windows of n steps: flat for two windows, a rise over two, 20x held for two, a
    fall over two, flat again."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(steps, dtype=torch.float64) / n
    scale = 1 + 19 * torch.clamp(torch.minimum((t - 2) / 2, (8 - t) / 2), 0, 1)
    return (torch.rand(steps, 1, dim, generator=g, dtype=torch.float64) * scale.view(-1, 1, 1)).float()


def musicnn_stream(shared: Path, steps: int) -> torch.Tensor:
    with np.load(shared / "gtzan_musicnn_tokens" / "evaluation_data_GTZAN_MSDmusicnn_taggram.npz") as d:
        X = d["X"][:steps]
    assert len(X) == steps
    return torch.as_tensor(X, dtype=torch.float32).unsqueeze(1)


def events_of(model) -> list[int]:
    """(rebuilt, landmark replaced, rows refreshed, rescaled) of the step just taken."""
    return model.events[0].tolist()


@pytest.mark.parametrize("name", ["musicnn-continual", "musicnn-continual_nystrom",
                                  "musicnn-continual_nystrom-fixed"])
def test_the_exported_step_equals_the_torch_step_for_ten_windows(name, tmp_path, capsys, errors, request):
    check_parity(name, MODELS / f"{name}.pt", tmp_path, capsys, errors, request)


@pytest.mark.parametrize("variant", ["continual", "continual_nystrom", "continual_nystrom-fixed"])
def test_a_2_block_export_equals_the_torch_step_for_ten_windows(variant, tmp_path, capsys, errors, request):
    """Block 0 retroactive, block 1 fed its whole window: the shipped models' shape with 2
    blocks, seeded weights; fixed landmarks fitted (k-means) on a stream of the same scale."""
    from app.checkpoint import save_checkpoint
    from models.landmarks import fit_fixed_landmarks
    from models.transformer import build_model
    shipped, payload = load_checkpoint(MODELS / "musicnn-continual_nystrom.pt", fused=False)
    cfg = shipped.cfg.replace(variant=variant.split("-")[0], layers=2)
    model = build_model(cfg, seed=0, fused=False).eval()
    if variant.endswith("fixed"):
        n = cfg.window
        fit_fixed_landmarks(model, swinging_stream(n * 34, cfg.in_dim, 1, n).view(34, n, cfg.in_dim))
    save_checkpoint(model, tmp_path / "two.pt", classes=payload["classes"], frontend=payload["frontend"])
    check_parity(f"2-block {variant}", tmp_path / "two.pt", tmp_path, capsys, errors, request, real_tokens=False)


def check_parity(name: str, checkpoint: Path, tmp_path, capsys, errors, request, real_tokens: bool = True) -> None:
    """ONNX Runtime and the float32 torch step against the float64 torch step, every step of
    both streams (``real_tokens`` False: the swinging stream alone, for seeded weights, to which
    real taggrams are no more typical than random tokens of their scale); the events and the
    FLOPs the exported step reports are the torch step's."""
    out = export(checkpoint, tmp_path / "m.onnx", capsys)
    model, payload = load_checkpoint(checkpoint, fused=False)
    exact = copy.deepcopy(model).double()
    onnx = OnnxStep(tmp_path / "m.onnx")
    cfg = model.cfg
    assert (list(onnx.classes), onnx.frontend, onnx.cfg) == (payload["classes"], payload["frontend"], cfg)
    assert out["kind"] == onnx.kind and out["blocks"] == cfg.layers and out["max_logit_difference"] < 1e-3
    steps = WINDOWS * cfg.window
    streams = {"20x swing": swinging_stream(steps, cfg.in_dim, 0, cfg.window)}
    shared = ROOT.parent / "shared" / "data"
    if shared.is_dir() and real_tokens:
        streams["musicnn tokens"] = musicnn_stream(shared, steps)
    elif real_tokens and request.config.getoption("--margins") is None:
        print("shared data absent: the musicnn-token stream is not run")
    stages = STAGES * cfg.layers
    for label, tokens in streams.items():
        for m in (model, exact, onnx):
            m.reset(1)
        worst, replaced = {"onnx": (0.0, 1.0), "torch": (0.0, 1.0)}, 0
        for t, x in enumerate(tokens):
            want = exact.step(x.double())
            # the error model: float32 stages against float64, relative to the output's scale,
            # with this window's largest score and its n terms
            window = tokens[max(0, t + 1 - cfg.window):t + 1].transpose(0, 1).double()
            tol = relative_tol(model_scores(exact, window, exact.window_start()), cfg.window, stages)
            scale = max(1.0, want.abs().max().item())
            for path, got in (("onnx", onnx.step(x)), ("torch", model.step(x))):
                err = (got.double() - want).abs().max().item() / scale
                if err / tol > worst[path][0] / worst[path][1]:
                    worst[path] = (err, tol)
            events = events_of(model)
            assert onnx._events.tolist() == events, (label, t)     # the same rebuilds, replacements, rows
            assert flops_apart(onnx, model) == 0, (label, t)
            replaced += events[1]
        for path, (err, tol) in worst.items():
            errors(f"{name} {label}: {path} vs float64", err, tol)
        if onnx.landmark_mode == "continual":                        # one landmark every n/m tokens
            assert replaced >= (steps - cfg.window) // (cfg.window // cfg.num_landmarks + 1)


def flops_apart(onnx, model) -> int:
    return onnx.step_flops()["model"] - model.step_flops()["model"]


def test_export_refuses_what_has_no_explicit_state_step_with_one_line(tmp_path, capsys):
    for name, says in (("musicnn-regular", "a 'regular' model recomputes its window each step"),
                       ("musicnn-nystrom", "a 'nystrom' model recomputes its window each step")):
        assert main(["export", "--checkpoint", str(MODELS / f"{name}.pt"), "--onnx", str(tmp_path / "x.onnx")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and "exportable: continual, continual_nystrom" in err[0]
    assert main(["export", "--checkpoint", str(tmp_path / "missing.pt"), "--onnx", str(tmp_path / "x.onnx")]) == 1
    assert capsys.readouterr().err.strip() == f"error: checkpoint not found: {tmp_path / 'missing.pt'}"
    assert not (tmp_path / "x.onnx").exists()
    (tmp_path / "not.onnx").write_bytes(b"\x08\x01garbage")
    with pytest.raises(OnnxModelError, match="is not a readable ONNX model"):
        OnnxStep(tmp_path / "not.onnx")
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    other = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]))
    onnx.save(other, tmp_path / "other.onnx")
    with pytest.raises(OnnxModelError, match="is not a Nystream streaming-step export"):
        OnnxStep(tmp_path / "other.onnx")


def example() -> str:
    text = (ROOT / "docs" / "onnx.md").read_text()
    block = re.search(r"<!-- example: begin -->\n```python\n(.*?)```\n<!-- example: end -->", text, re.S)
    assert block, "the example's markers are missing from docs/onnx.md"
    return block.group(1)


BLOCK_IMPORTS = """import builtins, sys
_real = builtins.__import__
def _only_onnxruntime_and_numpy(name, *args, **kw):
    if name.split(".")[0] in {"torch", "onnx", "onnxscript", "app", "models", "audio", "librosa", "sklearn"}:
        raise ImportError(f"{name} is not available to this example")
    return _real(name, *args, **kw)
builtins.__import__ = _only_onnxruntime_and_numpy
sys.argv = sys.argv[1:]
exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"))
"""


def test_the_docs_example_streams_an_export_without_torch(tmp_path, capsys):
    code = example()
    assert len(code.strip().splitlines()) <= 30
    export(MODELS / "musicnn-continual_nystrom-fixed.pt", tmp_path / "m.onnx", capsys)
    tokens = np.random.default_rng(0).random((40, 50)).astype(np.float32)
    np.savez(tmp_path / "tokens.npz", X=tokens)
    (tmp_path / "example.py").write_text(code)
    (tmp_path / "guard.py").write_text(BLOCK_IMPORTS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "guard.py", "example.py", "m.onnx", "tokens.npz"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    printed = [line.split() for line in r.stdout.splitlines()]
    # the same tokens through the app's ONNX step, a copy per phase as the engine feeds it: the same genres
    onnx = OnnxStep(tmp_path / "m.onnx")
    spacing = onnx.frontend["spacing_hops"]
    batch = onnx.batch(spacing)
    phases = [batch.join() for _ in range(spacing)]
    genres = [onnx.classes[int(batch.step([phases[t % spacing]], torch.from_numpy(x[None])).argmax())]
              for t, x in enumerate(tokens)]
    assert [int(p[0]) for p in printed] == list(range(40)) and [p[1] for p in printed] == genres


def test_classify_runs_an_export_beside_the_torch_models(tmp_path, capsys):
    export(MODELS / "musicnn-continual_nystrom-fixed.pt", tmp_path / "m.onnx", capsys)
    assert main(["classify", "--demo", "--seconds", "1", "--random-vggish", "--onnx", str(tmp_path / "m.onnx")]) == 1
    assert "was exported from a model trained on musicnn tokens; run it with --frontend musicnn" in capsys.readouterr().err
    assert main(["classify", "--demo", "--seconds", "5", "--jsonl", "--checkpoint",
                 str(MODELS / "musicnn-continual_nystrom-fixed.pt"), "--onnx", str(tmp_path / "m.onnx")]) == 0
    records = [json.loads(x) for x in capsys.readouterr().out.splitlines()][:-1]     # less the verdict
    assert len(records) == 20
    for r in records:
        torch_model, onnx_model = r["models"]["continual_nystrom/fixed"], r["models"]["onnx:continual_nystrom/fixed"]
        # the same weights and tokens: probabilities within the float32 error of two paths
        assert np.abs(np.subtract(torch_model["probabilities"], onnx_model["probabilities"])).max() < 1e-4
        assert onnx_model["flops"]["sda"] > 0 and onnx_model["latency_ms"] > 0
