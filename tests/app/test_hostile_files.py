"""Hostile files (tests/hostile_files.py makes them): each is refused, or skipped, with one line
and no traceback, in a command run as a user runs it, in a process under a memory limit.

The limit: the child imports the libraries the app uses, then caps its address space at what it
has plus LIMIT_HEADROOM, and reports how far its resident memory grew. Every bomb here asks for
more than that headroom, so a loader that regresses fails with a MemoryError (or its traceback)
rather than passing slowly; the growth bound is what a refusal may cost at most.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hostile_files as H
from audio_helpers import tone, write

ROOT = Path(__file__).resolve().parents[2]
LIMIT_HEADROOM = 1 << 30        # address space the command may add to what its imports took
GROWTH_BOUND = 400 << 20        # resident memory a refusal may add (front end weights included)

CHILD = r"""
import resource, sys
sys.path.insert(0, sys.argv[1])
import numpy, torch, onnx, onnxruntime, soundfile, soxr   # the libraries' own memory, before the cap
from app import cli

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

cap = status("VmSize:") + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
before = status("VmRSS:")
sys.argv = ["main.py", *sys.argv[3:]]
try:
    code = cli.main()                       # as main.py runs it (its process's heap policy too)
finally:
    print(f"GROWTH {status('VmHWM:') - before}", file=sys.stderr)
sys.exit(code)
"""


def run_capped(*args, timeout=240) -> tuple[int, str, int]:
    """(exit status, stderr without the growth line, resident growth in bytes) of main.py ARGS."""
    r = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(LIMIT_HEADROOM), *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = r.stderr.splitlines()
    growth = next((int(x.split()[1]) for x in lines if x.startswith("GROWTH ")), -1)
    return r.returncode, "\n".join(x for x in lines if not x.startswith("GROWTH ")), growth


def refused(args, phrase: str, code: int = 1) -> str:
    rc, err, growth = run_capped(*args)
    assert rc == code, err
    assert "Traceback" not in err and "MemoryError" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and phrase in errors[0], err
    assert 0 <= growth < GROWTH_BOUND, f"grew {growth / 2**20:.0f} MB"
    return errors[0]


# ----------------------------------------------------------------------------- checkpoints
def test_a_deflate_checkpoint_bomb_is_refused_before_it_inflates(tmp_path):
    bomb = H.deflate_checkpoint(tmp_path / "bomb.pt")             # 1.5 GB inflated, ~7 MB on disk
    refused(["export", "--checkpoint", bomb, "--onnx", tmp_path / "o.onnx"], "is compressed")
    assert not (tmp_path / "o.onnx").exists()


def test_a_checkpoint_whose_zip_claims_more_than_it_holds_is_refused(tmp_path):
    from app.checkpoint import CheckpointError, load_checkpoint
    with pytest.raises(CheckpointError, match="declares 3,221,225,472 bytes that the file does not hold"):
        load_checkpoint(H.lying_checkpoint(tmp_path / "lie.pt"))


def test_a_weight_claiming_a_huge_shape_is_refused_by_its_shape_before_any_copy(tmp_path):
    """A checkpoint whose weight claims a (2^16, 2^16) shape as a stride-0 view of one float:
    refused by its shape before any copy or NaN check touches 16 GB."""
    import torch
    from app.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from tiny import tiny_model
    model = tiny_model("continual", n=8, in_dim=50)
    save_checkpoint(model, tmp_path / "ok.pt", classes=[f"g{i}" for i in range(10)])
    payload = torch.load(tmp_path / "ok.pt", weights_only=True)
    key = next(iter(payload["state_dict"]))
    payload["state_dict"][key] = torch.zeros(1).expand(1 << 16, 1 << 16)
    torch.save(payload, tmp_path / "wide.pt")
    with pytest.raises(CheckpointError, match=rf"state_dict.{key}' must be a float tensor of shape"):
        load_checkpoint(tmp_path / "wide.pt")


# ----------------------------------------------------------------------------- exported steps
@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    """A real export of a small 1-block continual model on musicnn tokens."""
    from app.offline.onnx_export import export_onnx
    from tiny import tiny_model
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    export_onnx(tiny_model("continual", n=8, in_dim=50), path, classes=[f"genre{i}" for i in range(10)],
                frontend={"name": "musicnn", "token_dim": 50, "spacing_hops": 4})
    return path


def with_metadata(src: Path, dst: Path, drop=(), **changes) -> Path:
    import onnx
    model = onnx.load(str(src))
    meta = {p.key: p.value for p in model.metadata_props if p.key not in drop}
    meta.update({k: v if isinstance(v, str) else __import__("json").dumps(v) for k, v in changes.items()})
    del model.metadata_props[:]
    for k, v in meta.items():
        model.metadata_props.add(key=k, value=v)
    onnx.save(model, str(dst))
    return dst


def test_an_onnx_constant_folding_bomb_is_refused_before_a_session_exists(tmp_path, tiny_export):
    """Alone (180 bytes, no step's inputs), and inside a real export beside its step."""
    import onnx
    from onnx import TensorProto, helper
    from app.runtime.onnx_step import OnnxModelError, OnnxStep
    with pytest.raises(OnnxModelError, match="inputs are not those of a continual step"):
        OnnxStep(H.onnx_folding_bomb(tmp_path / "alone.onnx"))
    model = onnx.load(str(tiny_export))
    model.graph.initializer.append(helper.make_tensor("bomb_shape", TensorProto.INT64, [2], [16384, 16384]))
    model.graph.node.append(helper.make_node("ConstantOfShape", ["bomb_shape"], ["bomb"],
                                             value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])))
    onnx.save(model, str(tmp_path / "inside.onnx"))
    refused(["classify", "--demo", "--seconds", "1", "--onnx", tmp_path / "inside.onnx"],
            "would hold 268,435,456 elements")


def test_the_size_bound_is_the_configs_own_and_no_tensor_in_the_file_raises_it(tmp_path, tiny_export):
    """The bound's base is the largest tensor of a step of the config: a real export's largest
    initializer and largest inferred value equal it. An initializer declaring more (its data need
    not even be there) is refused, and so is a folding bomb beside it."""
    import math

    import onnx
    from onnx import TensorProto, helper

    from app.runtime.onnx_step import OnnxModelError, OnnxStep, all_graphs, checked_file, size_base
    meta = checked_file(tiny_export)
    model = onnx.load(str(tiny_export))
    inits = [math.prod(t.dims) for g in all_graphs(model.graph) for t in g.initializer]
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    values = [math.prod(d.dim_value for d in v.type.tensor_type.shape.dim)
              for g in all_graphs(inferred.graph) for v in list(g.value_info) + list(g.output)
              if all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)]
    assert max(inits) == max(values) == size_base(meta["config"], meta["kind"])
    model.graph.initializer.append(TensorProto(name="inflate", data_type=TensorProto.FLOAT, dims=[4096, 4096]))
    model.graph.initializer.append(helper.make_tensor("bomb_shape", TensorProto.INT64, [2], [4096, 4096]))
    model.graph.node.append(helper.make_node("ConstantOfShape", ["bomb_shape"], ["bomb"]))
    onnx.save(model, str(tmp_path / "inflated.onnx"))
    with pytest.raises(OnnxModelError, match=r"tensor 'inflate' has shape \(4096, 4096\), over the 49,152"):
        OnnxStep(tmp_path / "inflated.onnx")


@pytest.mark.parametrize("case, changes, drop, phrase", [
    ("no kind", {}, ("kind",), "metadata 'kind' is missing"),
    ("unknown kind", {"kind": "regular"}, (), "metadata 'kind' must be one of"),
    ("spacing 10^9", {"frontend": {"name": "musicnn", "token_dim": 50, "spacing_hops": 10**9}}, (),
     "frontend.spacing_hops' must be an integer in 1..64"),
    ("classes a string", {"classes": '"ab"'}, (), "metadata 'classes' must be a list of 10"),
    ("nine classes", {"classes": [f"g{i}" for i in range(9)]}, (), "must be a list of 10"),
    ("config not JSON", {"config": "{nope"}, (), "metadata 'config' is not JSON"),
    ("config of another window", {"config": "WINDOW"}, (), "inputs are not those of a continual step"),
    ("config over the limits", {"config": "HUGE"}, (), "window must be in 1..8192"),
    ("huge metadata", {"usage": "x" * 70000, "config": "BIG"}, (), "over 65,536"),
])
def test_absurd_export_metadata_is_refused_in_one_line(tmp_path, tiny_export, case, changes, drop, phrase):
    import json

    import onnx

    from app.runtime.onnx_step import OnnxModelError, OnnxStep
    real = {p.key: p.value for p in onnx.load(str(tiny_export)).metadata_props}
    changes = dict(changes)
    if changes.get("config") in ("WINDOW", "HUGE"):      # a real window, not this graph's; or none
        changes["config"] = {**json.loads(real["config"]), "window": 4000 if changes["config"] == "WINDOW" else 200000}
    if changes.get("config") == "BIG":
        changes["config"] = json.loads(real["config"]) | {"note": "y" * 70000}
        changes.pop("usage")
    path = with_metadata(tiny_export, tmp_path / "m.onnx", drop, **changes)
    with pytest.raises(OnnxModelError, match=phrase) as e:
        OnnxStep(path)
    assert "\n" not in str(e.value)


def test_an_export_with_real_metadata_and_another_graph_is_refused_at_load(tmp_path, tiny_export):
    """The metadata of a window-8 model on the graph of a window-6 one: the inputs say so."""
    from app.offline.onnx_export import export_onnx
    from app.runtime.onnx_step import OnnxModelError, OnnxStep
    from tiny import tiny_model
    other = tmp_path / "other.onnx"
    export_onnx(tiny_model("continual", n=6, in_dim=50), other, classes=[f"genre{i}" for i in range(10)],
                frontend={"name": "musicnn", "token_dim": 50, "spacing_hops": 4})
    import onnx
    real = {p.key: p.value for p in onnx.load(str(tiny_export)).metadata_props}
    with pytest.raises(OnnxModelError, match="inputs are not those of a continual step"):
        OnnxStep(with_metadata(other, tmp_path / "swapped.onnx", **real))
    assert OnnxStep(tiny_export).cfg.window == 8                  # the real one loads


def test_an_export_that_keeps_its_weights_in_another_file_is_refused(tmp_path, tiny_export):
    import onnx
    from app.runtime.onnx_step import OnnxModelError, OnnxStep
    from onnx.external_data_helper import convert_model_to_external_data
    model = onnx.load(str(tiny_export))
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    onnx.save(model, str(tmp_path / "ext.onnx"))
    with pytest.raises(OnnxModelError, match="keeps its data in another file"):
        OnnxStep(tmp_path / "ext.onnx")


# ----------------------------------------------------------------------------- token files
def test_a_token_file_with_a_huge_label_and_no_genres_is_refused(tmp_path):
    refused(["train", "--tokens", H.token_file_huge_label(tmp_path / "t.npz"), "--out", tmp_path / "m.pt"],
            "labels reach 2,147,483,648 but the file names no genres")


def test_a_token_file_with_a_huge_declared_shape_is_refused_from_its_header(tmp_path):
    from audio.tokens.cache import TokenFileError, load_tokens
    with pytest.raises(TokenFileError, match=r"declares shape \(1048576, 1024, 1024\) of float32"):
        load_tokens(H.token_file_huge_shape(tmp_path / "t.npz"))


def test_token_file_headers_bound_text_and_class_counts(tmp_path):
    from audio.tokens.cache import TokenFileError, load_tokens
    X = np.zeros((2, 3, 4), np.float32)
    np.savez(tmp_path / "ids.npz", X=X, labels=np.zeros(2, int), ids=np.array(["a" * 5000, "b"]))
    with pytest.raises(TokenFileError, match="ids holds text of up to 5,000 characters"):
        load_tokens(tmp_path / "ids.npz")
    np.savez(tmp_path / "genres.npz", X=X, labels=np.zeros(2, int), genres=np.array([str(i) for i in range(1001)]))
    with pytest.raises(TokenFileError, match="genres names 1,001 classes"):
        load_tokens(tmp_path / "genres.npz")
    np.savez(tmp_path / "ctl.npz", X=X, labels=np.zeros(2, int), genres=np.array(["rock\x1b[2J"]))
    with pytest.raises(TokenFileError, match="control characters"):
        load_tokens(tmp_path / "ctl.npz")
    np.savez(tmp_path / "ok.npz", X=X, labels=np.array([0, 3]))                  # no genres: '0'..'3'
    assert load_tokens(tmp_path / "ok.npz").genres == ("0", "1", "2", "3")


# ----------------------------------------------------------------------------- audio
def test_audio_headers_with_absurd_claims_are_refused(tmp_path):
    """2^36 frames through `classify` under the cap; a 1 Hz FLAC and WAV by the probe itself."""
    from audio.decoding import probe
    from audio.errors import AudioFileError
    refused(["classify", H.flac_claiming(tmp_path / "long.flac"), "--window", "8", "--seconds", "1"],
            "hours of audio, over the 24 h")
    for path in (H.flac_claiming(tmp_path / "slow.flac", frames=16000, rate=1), H.wav_claiming(tmp_path / "slow.wav")):
        with pytest.raises(AudioFileError, match="sample rate of 1 Hz"):
            probe(path)


def test_a_wav_claiming_more_data_than_it_has_reads_what_is_there(tmp_path):
    from audio.decoding import decode_file
    signal, _ = decode_file(H.wav_claiming(tmp_path / "claims.wav", rate=16000, frames=1 << 36))
    assert len(signal) == 1000


def test_extract_skips_hostile_tracks_with_their_reasons_and_keeps_the_rest(tmp_path):
    """A GTZAN-shaped folder (whose path is not UTF-8) with one real track and three hostile
    ones: the real one becomes tokens, each hostile one a skipped track named with its reason."""
    root = tmp_path / os.fsdecode(b"gtzan\xff")
    (root / "blues").mkdir(parents=True)
    write(tmp_path / "real.wav", tone(4.0, 22050, 440.0), 22050)     # soundfile writes UTF-8 names only
    os.rename(tmp_path / "real.wav", root / "blues" / "blues.00000.wav")
    H.flac_claiming(root / "blues" / "blues.00001.wav")            # a FLAC named .wav: still probed
    H.wav_claiming(root / "blues" / "blues.00002.wav")
    H.flac_claiming(root / "blues" / "blues.00003.wav", frames=16000, rate=1)
    rc, err, growth = run_capped("extract", "--gtzan", root, "--out", tmp_path / "t.npz", timeout=400)
    assert rc == 0 and "Traceback" not in err, err
    skipped = [line for line in err.splitlines() if line.strip().startswith("skipped blues/")]
    assert len(skipped) == 3 and "\\xff" in skipped[0], err
    from audio.tokens.cache import load_tokens
    tokens = load_tokens(tmp_path / "t.npz")
    assert list(tokens.ids) == ["blues/blues.00000.wav"] and len(tokens.metadata["skipped"]) == 3


def run_main(capsys, *args) -> tuple[int, str]:
    """main.py ARGS in this process (no memory cap needed): (exit status, stderr)."""
    from app.cli import main
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def test_a_valid_file_with_a_name_that_is_not_utf8_is_classified(tmp_path, capsys):
    path = tmp_path / os.fsdecode(b"bad\xff.wav")
    write(tmp_path / "good.wav", tone(3.0, 16000, 440.0), 16000)
    os.rename(tmp_path / "good.wav", path)
    code, err = run_main(capsys, "classify", path, "--window", "8")
    assert code == 0, err
    assert "# verdict over file:bad\\xff.wav" in err and "cannot decode" not in err


# ----------------------------------------------------------------------------- writes
def test_a_link_planted_at_a_temporary_name_is_never_written_through(tmp_path):
    from audio.files import atomic_write_text, temporary_path
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "report.md"
    os.symlink(victim, temporary_path(out))
    atomic_write_text(out, "report")
    assert victim.read_text() == "precious" and out.read_text() == "report" and not out.is_symlink()
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def test_a_checkpoint_temporary_that_is_a_link_is_never_written_through(tmp_path):
    from app.checkpoint import save_checkpoint
    from tiny import tiny_model
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "m.pt"
    os.symlink(victim, out.with_name(f".{out.name}.{os.getpid()}.tmp"))
    save_checkpoint(tiny_model("continual", n=8, in_dim=50), out, classes=[f"g{i}" for i in range(10)])
    assert victim.read_text() == "precious" and out.stat().st_size > 1000


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    from app.runtime.output_lock import OutputLocked, lock_path, output_lock
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "tokens.npz"
    os.symlink(victim, lock_path(out))
    with pytest.raises(OutputLocked, match="is not a regular file"):
        with output_lock(out, "extract"):
            pass
    assert victim.read_text() == "precious"
    os.unlink(lock_path(out))
    os.mkfifo(lock_path(out))
    with pytest.raises(OutputLocked, match="is not a regular file"):
        with output_lock(out, "extract"):
            pass


def test_csv_output_over_a_link_replaces_the_link_not_its_target(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "steps.csv"
    os.symlink(victim, out)
    code, err = run_main(capsys, "classify", "--demo", "--seconds", "1", "--window", "8", "--csv", out)
    assert code == 0, err
    assert victim.read_text() == "precious" and not out.is_symlink()
    assert len(list(csv.DictReader(out.open()))) == 4


def test_a_parts_folder_that_is_a_link_is_refused(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "g" / "blues").mkdir(parents=True)
    write(tmp_path / "g" / "blues" / "blues.00000.wav", tone(1.0, 16000, 440.0), 16000)
    os.symlink(elsewhere, tmp_path / "t.npz.parts")
    code, err = run_main(capsys, "extract", "--gtzan", tmp_path / "g", "--out", tmp_path / "t.npz")
    assert code == 1 and "is a link" in err, err
    assert list(elsewhere.iterdir()) == []


# ----------------------------------------------------------------------------- names
def test_class_names_with_formulas_are_prefixed_in_csv_and_control_characters_refused(tmp_path, capsys):
    from app.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from tiny import tiny_model
    names = ["=HYPERLINK(\"http://x\")", "+1", "-1", "@SUM(A1)", "<b>bold</b>"] + [f"g{i}" for i in range(5)]
    model = tiny_model("continual", n=8, in_dim=50)
    frontend = {"name": "musicnn", "token_dim": 50, "spacing_hops": 4}
    save_checkpoint(model, tmp_path / "m.pt", classes=names, frontend=frontend)
    out = tmp_path / "steps.csv"
    code, err = run_main(capsys, "classify", "--demo", "--seconds", "2", "--checkpoint", tmp_path / "m.pt",
                         "--csv", out)
    assert code == 0, err
    rows = list(csv.reader(out.open()))
    cells = [c for row in rows for c in row]
    assert not any(c.startswith(("=", "+", "@")) or (c.startswith("-") and not is_number(c)) for c in cells)
    assert any(c.endswith("p_=HYPERLINK(\"http://x\")") for c in rows[0])       # the header names it
    payload_names = ["rock\x1b]0;pwned\x07"] + [f"g{i}" for i in range(9)]
    import torch
    payload = torch.load(tmp_path / "m.pt", weights_only=True)
    payload["classes"] = payload_names
    torch.save(payload, tmp_path / "ctl.pt")
    with pytest.raises(CheckpointError, match="printable UTF-8"):
        load_checkpoint(tmp_path / "ctl.pt")


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def test_terminal_lines_strip_control_characters_from_names():
    from app.runtime.records import ModelStep, StepResult, human
    step = ModelStep(probabilities=[0.9, 0.1], classes=["rock\x1b[2J", "pop"], flops={"sda": 1000},
                     latency_ms=0.1, state_bytes=0, trained=True, landmark_mode=None, landmark_update=False,
                     warm=True, spacing=1, variant="continual", layers=1, window=8)
    line = human(StepResult(0, 0.25, "demo", "musicnn", {"onnx:x\x1b[31m": step},
                            {"frontend": 1.0, "mel": 0.5, "network": 0.5, "control": 0.0}))
    assert "\x1b" not in line and "rock\\x1b[2J" in line


def test_a_sweep_work_folder_someone_else_could_write_is_not_restored(tmp_path):
    """Ray Tune's restore unpickles the experiment's files: restored only when the user alone
    can write every file and folder in it (no links)."""
    from app.offline.sweep import UntrustedWorkError, check_trusted
    experiment = tmp_path / "tune" / "sweep-abc"
    (experiment / "trial").mkdir(parents=True)
    os.chmod(tmp_path / "tune", 0o755)
    for folder in (experiment, experiment / "trial"):
        os.chmod(folder, 0o755)
    (experiment / "tuner.pkl").write_bytes(b"pickle")
    os.chmod(experiment / "tuner.pkl", 0o644)
    check_trusted(experiment)                                     # the user's own run: restored
    os.chmod(experiment / "tuner.pkl", 0o666)
    with pytest.raises(UntrustedWorkError, match="tuner.pkl is writable by others"):
        check_trusted(experiment)
    os.chmod(experiment / "tuner.pkl", 0o644)
    os.symlink(tmp_path / "elsewhere.pkl", experiment / "trial" / "params.pkl")
    with pytest.raises(UntrustedWorkError, match="params.pkl is a link"):
        check_trusted(experiment)
