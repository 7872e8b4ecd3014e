"""`nystream classify` end to end on real files, and its errors: through the command's entry point
in this process (tests/cli_helpers.py), and in a process of its own where the process is the
point (standard input, descriptor 1, a background build)."""
import csv
import json
import subprocess

import pytest
import sys
from pathlib import Path

from audio_helpers import tone, write
from cli_helpers import Ran, run_command

ROOT = Path(__file__).resolve().parents[2]


def classify(*args) -> Ran:
    return run_command("classify", *args)


def classify_process(*args, stdin=None) -> subprocess.CompletedProcess:
    """`main.py classify ARGS` in a process of its own (bytes in and out)."""
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "classify", *map(str, args)], input=stdin,
                          capture_output=True, timeout=300, cwd=ROOT)


def test_classify_file_jsonl(tmp_path):
    path = write(tmp_path / "a.wav", tone(2.2, 44100, 523.0, channels=2), 44100)
    r = classify(path, "--random-vggish", "--jsonl", "--window", "8")
    assert r.returncode == 0, r.stderr
    *records, verdict = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["step"] for x in records] == list(range(8))
    assert verdict["source"] == "file:a.wav" and verdict["hops"] == 8 and set(verdict["verdict"]) == set(records[0]["models"])
    first = records[0]
    models = first["models"]
    assert set(models) == {"regular", "continual", "nystrom", "continual_nystrom"}
    assert abs(sum(models["continual"]["probabilities"]) - 1) < 1e-4
    assert not any(m["trained"] for m in models.values()) and "RANDOM" in first["frontend"]
    assert models["continual_nystrom"]["flops"]["sda"] > 0
    assert set(first["stages"]) == {"frontend", "mel", "network", "control"} and models["regular"]["latency_ms"] > 0
    # exact variants agree at every step
    for x in records:
        assert x["models"]["regular"]["top"][0] == x["models"]["continual"]["top"][0]
    assert "UNTRAINED" in r.stderr


def test_classify_demo_csv(tmp_path):
    out = tmp_path / "steps.csv"
    r = classify("--demo", "--seconds", "1.5", "--random-vggish", "--variant", "continual",
                 "--variant", "continual_nystrom", "--csv", out)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 6 and rows[0]["continual.untrained"] == "True"
    assert float(rows[-1]["audio_time_s"]) == 1.5
    # nothing else shows progress with --csv: on a pipe, lines with the time left
    lines = [x for x in r.stderr.splitlines() if "steps written" in x]
    assert lines[-1].startswith(f"# 6 steps written to {out} (") and lines[-1].endswith("~0 s left)")
    assert len(lines) == 6                                    # one per tenth of 6 hops: every hop


def test_classify_bad_inputs_exit_nonzero_with_a_message(tmp_path):
    r = classify(tmp_path / "missing.wav", "--random-vggish")
    assert r.returncode == 1 and "not found" in r.stderr
    (tmp_path / "x.wav").write_text("not audio")
    r = classify(tmp_path / "x.wav", "--random-vggish")
    assert r.returncode == 1 and "cannot decode" in r.stderr
    good = write(tmp_path / "good.wav", tone(1.0, 16000), 16000)
    r = classify(good, "--vggish-weights", tmp_path / "none.pth")
    assert r.returncode == 1 and "VGGish weights not found" in r.stderr


def test_classify_with_a_checkpoint_marks_it_trained(tmp_path):
    import torch

    from audio.gtzan import GENRES
    from app.checkpoint import save_checkpoint
    from models.transformer import ModelConfig, build_model
    torch.manual_seed(0)
    model = build_model(ModelConfig(variant="continual", window=8))
    save_checkpoint(model, tmp_path / "c.pt", classes=list(GENRES))
    path = write(tmp_path / "a.wav", tone(1.2, 16000), 16000)
    r = classify(path, "--random-vggish", "--jsonl", "--checkpoint", tmp_path / "c.pt",
                 "--variant", "regular")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.splitlines()[-2])            # the last record; the verdict follows
    assert {n: not m["trained"] for n, m in rec["models"].items()} == {"continual": False, "regular": True}
    bad = classify(path, "--random-vggish", "--checkpoint", path)
    assert bad.returncode == 1 and "not a readable checkpoint" in bad.stderr


def test_classify_defaults_to_musicnn_and_the_most_accurate_shipped_model(tmp_path):
    """No flags: the musicnn front end and one answer, the shipped model of highest test
    accuracy (the cheaper step on a tie), trained, fed every 4th hop; the header says how to
    run them all."""
    from app.runtime.lineup import best_shipped, load_trained, shipped_checkpoints
    entries = [load_trained(p, "musicnn", "cpu") for p in shipped_checkpoints("musicnn")]
    best = best_shipped(entries)
    assert best.test_accuracy == max(e.test_accuracy for e in entries) > 0.5
    path = write(tmp_path / "a.wav", tone(3.0, 22050, 440.0), 22050)
    r = classify(path, "--jsonl")
    assert r.returncode == 0, r.stderr
    *records, verdict = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(records) == 12 and set(records[0]["models"]) == {best.name} == set(verdict["verdict"])
    assert records[0]["models"][best.name]["trained"] and records[0]["models"][best.name]["spacing"] == 4
    assert "--models all runs them all" in r.stderr.splitlines()[0]


def test_classify_all_shipped_models_and_their_verdicts_with_the_top_classes(tmp_path):
    """--models all: every shipped checkpoint, all trained, fed every 4th hop; the run ends with
    a verdict per model (the genre most often on top, its share of the steps, its mean
    probability, and the --top classes of highest mean probability), as the records say."""
    path = write(tmp_path / "a.wav", tone(3.0, 22050, 440.0), 22050)
    r = classify(path, "--jsonl", "--models", "all", "--top", "4")
    assert r.returncode == 0, r.stderr
    assert "# the musicnn push" not in r.stderr            # compiling off (tests/conftest.py)
    *records, verdict = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(records) == 12 and verdict["hops"] == 12
    first = records[0]
    assert set(first["models"]) == {"regular", "continual", "nystrom", "continual_nystrom",
                                           "continual_nystrom/fixed"}
    assert all(m["trained"] for m in first["models"].values()) and first["frontend"].startswith("musicnn")
    assert {m["spacing"] for m in first["models"].values()} == {4} and first["frontend_flops"] > 0
    for x in records:                 # the exact pairs agree at every step
        assert x["models"]["regular"]["top"][0] == x["models"]["continual"]["top"][0]
        assert x["models"]["regular"]["probabilities"] == pytest.approx(
            x["models"]["continual"]["probabilities"], abs=1e-5)
    # the per-file verdict (stderr, also with --jsonl), as the records say
    table = r.stderr[r.stderr.index("# verdict over file:a.wav"):].splitlines()[1:]
    assert table[0].split() == ["#", "model", "genre", "share", "of", "steps", "mean", "probability", "steps",
                                "highest", "mean", "probabilities"]
    rows = {line.split()[1]: line.split()[2:] for line in table[1:6]}
    assert set(rows) == set(first["models"])
    for name, (genre, share, mean, steps, *top) in rows.items():
        tops = [x["models"][name]["top"][0] for x in records]
        classes = records[0]["models"][name]["classes"]
        means = {c: sum(x["models"][name]["probabilities"][i] for x in records) / len(records)
                 for i, c in enumerate(classes)}
        assert genre == max(set(tops), key=tops.count) and int(steps) == len(records)
        assert share == f"{100 * tops.count(genre) / len(tops):.0f}%"
        assert mean == f"{100 * means[genre]:.0f}%"
        v = verdict["verdict"][name]                      # the same verdict as data
        assert v["genre"] == genre and v["steps"] == len(records) and f"{100 * v['share']:.0f}%" == share
        want = sorted(means.items(), key=lambda cp: -cp[1])[:4]
        assert [c for c, _ in v["top"]] == [c for c, _ in want]
        assert [p for _, p in v["top"]] == pytest.approx([p for _, p in want], abs=1e-6)   # float32 sums
        assert " ".join(top).split(", ")[0] == f"{want[0][0]} {100 * want[0][1]:.0f}%"


def test_old_option_names_still_work_with_one_line_warnings(tmp_path, capsys):
    """--realtime / --fast (now --pace) and the microphone's --device NAME (now --input-device)
    keep working for one release, each saying its new form in one line."""
    r = classify("--demo", "--seconds", "0.5", "--fast", "--random-vggish", "--variant", "continual", "--jsonl")
    assert r.returncode == 0, r.stderr
    assert ("warning: --fast is deprecated and will be removed in the next release; use --pace fast"
            in r.stderr.splitlines())
    assert len([x for x in r.stdout.splitlines() if '"step"' in x]) == 2
    from app.cli import build_parser
    assert build_parser().parse_args(["classify", "--demo", "--realtime"]).pace == "realtime"
    args = build_parser().parse_args(["classify", "--mic", "--device", "USB mic"])
    assert (args.input_device, args.device) == ("USB mic", "cpu")
    assert capsys.readouterr().err.splitlines()[-1] == (
        "warning: --device USB mic is deprecated and will be removed in the next release; use --input-device "
        "USB mic (--device is now cpu or cuda)")
    args = build_parser().parse_args(["listen", "ws://x/v1/stream", "--mic", "--device", "3", "--fast"])
    assert (args.input_device, args.pace) == ("3", "fast")
    with pytest.raises(SystemExit):                        # where there is no microphone: still an error
        build_parser().parse_args(["extract", "--gtzan", ".", "--out", "t.npz", "--device", "gpu"])


def test_classify_refuses_a_checkpoint_of_another_front_end(tmp_path):
    path = write(tmp_path / "a.wav", tone(1.2, 16000), 16000)
    r = classify(path, "--checkpoint", ROOT / "assets/models/musicnn-continual.pt", "--random-vggish")
    assert r.returncode == 1 and "trained on musicnn tokens" in r.stderr and "--frontend musicnn" in r.stderr


def test_a_run_that_ends_before_its_first_row_writes_no_csv_and_says_so(tmp_path):
    """A FLAC whose frames are damaged from the first: the error, then the summary says no CSV
    was written (none is left behind)."""
    import numpy as np
    path = write(tmp_path / "c.flac", np.random.default_rng(0).uniform(-0.5, 0.5, 16000 * 3), 16000, "PCM_16")
    data = bytearray(path.read_bytes())
    for i in range(200, len(data), 7):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    out = tmp_path / "steps.csv"
    r = classify(path, "--window", "8", "--csv", out)
    assert r.returncode == 1 and "corrupt or truncated after 0.0 s" in r.stderr, r.stderr
    assert f"no rows, {out} not written" in r.stderr and not out.exists()


def test_one_stream_says_how_its_musicnn_push_ran(tmp_path, monkeypatch):
    """With the compiled push on and an empty cache, a short run ends before the library is
    built (its build needs a C++ compiler: here none, so it ends soon after): the run says, in
    one line, that its hops were eager while it builds."""
    monkeypatch.setenv("NYSTREAM_COMPILED_PUSH", "1")
    monkeypatch.setenv("NYSTREAM_PUSH_CACHE", str(tmp_path / "push"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    path = write(tmp_path / "a.wav", tone(3.0, 22050, 440.0), 22050)
    r = classify_process(path, "--jsonl")                   # its background build is this process's alone
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stderr.decode().splitlines() if x.startswith("# the musicnn push: ")]
    assert line == ["# the musicnn push: eager while its compiled form builds in the background (about a minute, once)"], r.stderr


def test_stdin_output_dir_csv_to_stdout_quiet_and_one_name_per_source(tmp_path):
    """`classify -` reads a file from standard input (named stdin); --output-dir writes one JSON
    per input as it ends, under the input's name (a folder's files under their folder): the
    verdict and hop records --jsonl prints; --csv - is the CSV on stdout; --quiet prints only the
    verdicts (with --jsonl, only the verdict records); the summary, the CSV and the JSON name a
    source the same way."""
    music = tmp_path / "music" / "jazz"
    music.mkdir(parents=True)
    a = write(music / "a.wav", tone(1.6, 22050, 440.0), 22050)
    b = write(tmp_path / "b.wav", tone(1.1, 16000, 660.0, channels=2), 16000)
    r = classify_process("-", "--quiet", stdin=a.read_bytes())
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    line, = r.stdout.decode().splitlines()
    assert line.startswith("stdin  continual  ") and "% of 6 steps; highest mean probabilities: " in line
    out = tmp_path / "out"
    jsonl = classify(tmp_path / "music", b, "--jsonl", "--summary", tmp_path / "s.csv", "--output-dir", out,
                     "--output-records")
    assert jsonl.returncode == 0, jsonl.stderr
    lines = [json.loads(x) for x in jsonl.stdout.splitlines()]
    verdicts = {x["source"]: x for x in lines if "verdict" in x}
    records = {s: [x for x in lines if x.get("source") == s and "step" in x] for s in verdicts}
    assert set(verdicts) == {"file:music/jazz/a.wav", "file:b.wav"} and verdicts["file:b.wav"]["path"] == str(b)
    summary = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert {(row["source"], row["file"]) for row in summary} == {("file:music/jazz/a.wav", str(a)),
                                                                 ("file:b.wav", str(b))}
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.json")) == ["b.wav.json",
                                                                                  "music/jazz/a.wav.json"]
    for name, path in (("file:b.wav", out / "b.wav.json"), ("file:music/jazz/a.wav", out / "music/jazz/a.wav.json")):
        written = json.loads(path.read_text())
        assert written.pop("records") == records[name] and written == verdicts[name]
    r = classify_process(b, "--csv", "-", "-q")             # the CSV goes to the process's descriptor 1
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(r.stdout.decode().splitlines()))
    assert [(row["source"], row["continual.top"]) for row in rows] == \
        [("file:b.wav", x["models"]["continual"]["top"][0]) for x in records["file:b.wav"]]
    assert len(r.stderr.splitlines()) == 1 and r.stderr.decode().startswith("file:b.wav  continual  ")
    r = classify(b, "--jsonl", "-q")
    assert r.returncode == 0 and r.stderr == "" and [json.loads(x) for x in r.stdout.splitlines()] == \
        [verdicts["file:b.wav"]]
    r = classify_process("-", stdin=b"")
    assert r.returncode == 1 and r.stderr.decode().splitlines()[-1] == \
        "error: standard input is empty (0 bytes): pipe audio into `classify -`"


def test_the_sample_that_ships_is_classical_to_every_shipped_model():
    """The README's first example runs from a clone: the sample in assets/ (scripts/make_sample.py's
    rendering of Bach's Prelude in C) is classical to each shipped model on nearly every step."""
    r = classify(ROOT / "assets" / "sample" / "prelude-bwv846.ogg", "--models", "all", "--jsonl", "-q")
    assert r.returncode == 0, r.stderr
    verdict, = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(verdict["verdict"]) == 5 and verdict["hops"] == 89
    assert all(v["genre"] == "classical" and v["share"] >= 0.9 for v in verdict["verdict"].values()), verdict
