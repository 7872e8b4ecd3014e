"""`classify` as a user's tool: verdicts as data, folders of files through a bounded number of
streams, repeatable options that never take the input, a smoothed reading, and a command line
that answers `--help` and `--version` without loading torch."""
import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from app.cli import build_parser, main
from audio_helpers import tone, write

ROOT = Path(__file__).resolve().parents[2]
FIXED = ROOT / "assets/models/musicnn-continual_nystrom-fixed.pt"
CONTINUAL = ROOT / "assets/models/musicnn-continual.pt"


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_options_that_name_several_things_are_repeated_and_never_take_the_input():
    song = "song.ogg"
    a = build_parser(["classify"]).parse_args(["classify", "--checkpoint", "a.pt", song])
    assert a.path == [song] and a.checkpoint == ["a.pt"]
    a = build_parser(["classify"]).parse_args(["classify", "--variant", "regular", song, "--checkpoint", "a.pt",
                                               "--checkpoint", "b.pt", "--onnx", "c.onnx"])
    assert a.path == [song] and a.variant == ["regular"] and a.checkpoint == ["a.pt", "b.pt"] and a.onnx == ["c.onnx"]
    s = build_parser(["serve"]).parse_args(["serve", "--checkpoint", "a.pt", "--checkpoint", "b.pt", "--variant", "nystrom"])
    assert s.checkpoint == ["a.pt", "b.pt"] and s.variant == ["nystrom"]
    g = build_parser(["gui"]).parse_args(["gui", "--add-model", "a.pt", "--add-model", "b.onnx", "--variant", "continual"])
    assert g.checkpoint == ["a.pt", "b.onnx"] and g.variant == ["continual"]


def test_a_file_classified_gives_its_verdict_as_data_and_a_summary_row_per_model(tmp_path, capsys):
    song = write(tmp_path / "a.wav", tone(3.0, 22050, 330.0), 22050)
    summary = tmp_path / "summary.csv"
    code, out, err = run(capsys, "classify", song, "--checkpoint", FIXED, "--checkpoint", CONTINUAL, "--jsonl",
                         "--summary", summary)
    assert code == 0, err
    *records, verdict = [json.loads(x) for x in out.splitlines()]
    assert [r["step"] for r in records] == list(range(12)) and "verdict" not in records[-1]
    assert verdict["source"] == "file:a.wav" and verdict["hops"] == 12 and verdict["error"] is None
    assert list(verdict["verdict"]) == ["continual_nystrom/fixed", "continual"]
    for name, v in verdict["verdict"].items():              # the verdict is the records' tally
        tops = [r["models"][name]["top"][0] for r in records]
        genre = max(set(tops), key=tops.count)
        assert v["genre"] == genre and v["steps"] == 12 and v["share"] == tops.count(genre) / 12
        mean = sum(r["models"][name]["probabilities"][r["models"][name]["classes"].index(genre)] for r in records) / 12
        assert math.isclose(v["confidence"], mean, rel_tol=1e-12)
    assert summary.read_text().splitlines()[0] == "file,source,model,genre,share,confidence,hops,error"
    rows = list(csv.DictReader(summary.open()))
    assert [(r["file"], r["source"], r["model"], r["genre"], r["hops"], r["error"]) for r in rows] == [
        (str(song), "file:a.wav", name, v["genre"], "12", "") for name, v in verdict["verdict"].items()]
    assert float(rows[0]["share"]) == round(verdict["verdict"]["continual_nystrom/fixed"]["share"], 6)
    assert err.splitlines()[0].startswith("# device cpu, float32; source file:a.wav;")


def test_smooth_gives_the_windows_reading_of_each_model(tmp_path, capsys):
    """--smooth S: each record's smoothed top is the top of the probabilities averaged with
    weight 1 - exp(-0.25 / S) for the newest hop, from the stream's first hop (recomputed here
    in float64 from the records' own probabilities)."""
    song = write(tmp_path / "a.wav", np.concatenate([tone(4.0, 16000, 220.0), tone(4.0, 16000, 1760.0)]), 16000)
    code, out, err = run(capsys, "classify", song, "--checkpoint", FIXED, "--smooth", "2", "--jsonl")
    assert code == 0, err
    records = [json.loads(x) for x in out.splitlines()][:-1]
    alpha, avg = 1 - math.exp(-0.25 / 2), None
    for r in records:
        m = r["models"]["continual_nystrom/fixed"]
        p = np.array(m["probabilities"], np.float64)
        avg = p if avg is None else avg + alpha * (p - avg)
        order = np.argsort(avg)[::-1]
        if avg[order[0]] - avg[order[1]] > 1e-9:           # float32 records, float64 here: a tie aside
            assert m["smoothed_top"][0] == m["classes"][order[0]]
        assert abs(m["smoothed_top"][1] - avg[order[0]]) < 1e-6
    code, out, _ = run(capsys, "classify", song, "--checkpoint", FIXED, "--jsonl", "--seconds", "1")
    assert "smoothed_top" not in out                            # without --smooth: the records as they were


def rss_and_fds(pid: int) -> tuple[float, int]:
    """Resident MB (app/runtime/memory.py) and open descriptors of process ``pid``."""
    from app.runtime.memory import rss_mb
    return rss_mb(pid), len(list(Path(f"/proc/{pid}/fd").iterdir()))


@pytest.mark.slow
def test_a_folder_of_200_files_runs_through_bounded_streams_with_flat_memory(tmp_path):
    """`classify DIR --streams 8`: 200 generated files in sub-folders (and two that cannot be
    decoded, a text file, a hidden file) run 8 at a time; the resident memory and the open
    descriptors after 50 files and near the last differ by less than a file held open per
    stream would add (its descriptor; its decoder's and resampler's buffers),
    and the summary has every file."""
    rng = np.random.default_rng(0)
    for i in range(200):
        folder = tmp_path / "music" / f"g{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        write(folder / f"t{i:03d}.wav", tone(0.6, 16000, float(rng.uniform(200, 2000))), 16000)
    (tmp_path / "music" / "g0" / "broken.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    (tmp_path / "music" / "g1" / "empty.flac").write_bytes(b"")
    (tmp_path / "music" / "notes.txt").write_text("not audio")
    (tmp_path / "music" / "._t000.wav").write_bytes(b"AppleDouble")
    summary, log = tmp_path / "summary.csv", (tmp_path / "stderr.txt").open("w")
    p = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "classify", str(tmp_path / "music"), "--streams", "8",
                          "--checkpoint", str(FIXED), "--jsonl", "--summary", str(summary)],
                         stdout=subprocess.PIPE, stderr=log, text=True, cwd=tmp_path)
    verdicts, at = 0, {}
    for line in p.stdout:
        if line.startswith('{"verdict"'):
            verdicts += 1
            if verdicts in (50, 195):
                at[verdicts] = rss_and_fds(p.pid)
    p.wait(timeout=300)
    err = (tmp_path / "stderr.txt").read_text()
    assert p.returncode == 1, err[-3000:]           # two files failed: exit 1, the rest ran
    assert verdicts == 200 and "Traceback" not in err
    assert sum(x.startswith("error: ") for x in err.splitlines()) == 2
    assert "# 2 files in the folders passed over (hidden, or not audio by their suffix)" in err
    assert "202 files, 8 at a time" in next(x for x in err.splitlines() if x.startswith("# device cpu"))
    (rss50, fds50), (rss195, fds195) = at[50], at[195]
    print(f"after 50 files {rss50:.1f} MB, {fds50} descriptors; after 195 {rss195:.1f} MB, {fds195}")
    # at most --streams files are open at any moment (3 to 10 descriptors measured at either
    # sample), so the later count is at most the earlier plus 8; a file held per stream adds 145
    assert fds195 <= fds50 + 8, (fds50, fds195)
    # measured: +0.1 to +16.8 MB in eight runs (the heap grows in steps, not per file); 40 MB
    # over 145 files is 280 KB a file, less than a decoder and resampler held per file
    assert rss195 - rss50 < 40, (rss50, rss195)
    rows = list(csv.DictReader(summary.open()))
    assert len(rows) == 202 and len({r["file"] for r in rows}) == 202
    failed = sorted(Path(r["file"]).name for r in rows if r["error"])
    assert failed == ["broken.wav", "empty.flac"] and all(r["model"] == "" for r in rows if r["error"])
    assert all(r["hops"] == "2" and r["genre"] for r in rows if not r["error"])


def test_help_and_version_answer_without_loading_torch():
    """Every command's help and the version, in one fresh process that never imports torch."""
    probe = ("import sys; from app.cli import main; from app.commands import HELP\n"
             "for argv in (['--help'], *([c, '--help'] for c in HELP), ['--version']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('torch' in sys.modules, file=sys.stderr)")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.stderr.strip().splitlines()[-1] == "False", r.stderr[-2000:]
    assert r.stdout.startswith("usage: nystream [-h] [--version] COMMAND ...") and "classify" in r.stdout
    assert "--input-device DEVICE" in r.stdout and r.stdout.rstrip().endswith(f"nystream {version()}")
    print(f"every help and the version in {time.monotonic() - t0:.2f} s")


def version() -> str:
    import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
