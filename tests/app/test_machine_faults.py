"""When the machine misbehaves, runs end with one line and lose nothing: a full disk (a real
tmpfs of 2 MB, filled), SIGTERM and SIGINT sent to real processes at start-up and mid-stream.
What each case does is listed in docs/bad-input.md."""
import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from app.runtime.csv_rows import CsvRows
from app.runtime.faults import exit_code, resource_message, restore, stop_on_signals, stop_received, Stopped
from audio_helpers import tone, write

ROOT = Path(__file__).resolve().parents[2]


def song(tmp_path, seconds=30.0) -> Path:
    freqs = (220, 330, 440, 660, 880)
    return write(tmp_path / "song.wav", np.concatenate([tone(seconds / len(freqs), 22050, f) for f in freqs]), 22050)


def main_py(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "main.py"), *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def complete_rows(path: Path) -> list[list[str]]:
    """The CSV's rows, each checked to have the header's fields; the file ends with a newline."""
    text = path.read_text()
    assert text.endswith("\n"), "the CSV ends in part of a row"
    rows = list(csv.reader(text.splitlines()))
    assert all(len(r) == len(rows[0]) for r in rows), "a row is cut short"
    return rows[1:]


def test_classify_on_a_full_disk_says_so_and_keeps_only_whole_rows(tmp_path, small_disk):
    mount, fill = small_disk
    fill(40_000)                                        # about 30 rows of five models
    out = mount / "steps.csv"
    p = main_py("classify", song(tmp_path), "--csv", out, "--models", "all")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1, err[-2000:]
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    rows = complete_rows(out)
    assert line == [f"error: no space left on the device: {out}; the CSV keeps its {len(rows)} complete rows"]
    assert 10 < len(rows) < 60 and [int(r[0]) for r in rows] == list(range(len(rows)))
    assert f"# {len(rows)} rows in {out}" in err and "# verdict over file:song.wav" in err


def test_extract_on_a_full_disk_names_the_resource_and_the_path(tmp_path, small_disk):
    mount, fill = small_disk
    gtzan = tmp_path / "gtzan"
    gtzan.mkdir()
    for i, genre in enumerate(("blues", "rock")):
        write(gtzan / f"{genre}.00000.wav", tone(3.0, 22050, 220 * (i + 1)), 22050)
    fill(0)
    p = main_py("extract", "--gtzan", gtzan, "--out", mount / "tokens.npz")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 1 and "Traceback" not in err, err[-2000:]
    assert any(x.startswith("error: no space left on the device: " + str(mount)) for x in err.splitlines()), err[-1000:]
    assert not (mount / "tokens.npz").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_stream_flushes_the_rows_and_prints_the_summary_and_verdict(tmp_path, sig):
    out = tmp_path / "steps.csv"
    p = main_py("classify", song(tmp_path, 60), "--pace", "realtime", "--csv", out)
    t0 = time.monotonic()
    while not (out.exists() and len(out.read_text().splitlines()) >= 5):   # header and 4 rows
        assert p.poll() is None and time.monotonic() - t0 < 120, p.communicate()[1][-2000:]
        time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig and "Traceback" not in err, err[-2000:]
    rows = complete_rows(out)
    assert f"# stopped by {signal.Signals(sig).name}" in err and f"# {len(rows)} rows in {out}" in err
    assert "# verdict over file:song.wav" in err and len(rows) >= 4


def test_a_stop_that_an_import_turns_into_another_error_still_ends_as_a_stop(monkeypatch, capsys):
    """numpy's C init turns a KeyboardInterrupt raised while it imports `datetime` into
    ImportError('PyCapsule_Import could not import module "datetime"'), with no chained cause."""
    from app import cli

    def run(_args):
        stopped = False
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)                              # the handler raises Stopped before this ends
        except KeyboardInterrupt:
            stopped = True
        assert stopped
        raise ImportError('PyCapsule_Import could not import module "datetime"')   # no __context__
    command = SimpleNamespace(command="starting", run=run)
    monkeypatch.setattr(cli, "build_parser", lambda argv=None: SimpleNamespace(parse_args=lambda argv: command))
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main([]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "# stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before   # the handlers it had are back
    def fails(_args):
        raise ImportError("no module named x")
    command.run = fails
    with pytest.raises(ImportError):                    # without a stop, the error is the error
        cli.main([])


def test_a_signal_while_starting_ends_with_one_line(tmp_path):
    path = song(tmp_path, 300)                          # 1,200 hops: seconds of work after any start
    for delay in (0.05, 0.3, 0.6, 1.0, 1.5):            # interpreter start, imports, model loading
        p = main_py("classify", path, "--csv", tmp_path / f"s{delay}.csv")
        time.sleep(delay)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode in (143, -signal.SIGTERM), (delay, err[-2000:])   # -15: before Python ran
        assert "Traceback" not in err, (delay, err[-2000:])
        if p.returncode == 143:                         # held while importing, taken after
            lines = err.strip().splitlines()
            stops = [i for i, line in enumerate(lines) if line.startswith("# stopped by SIGTERM")]
            assert len(stops) == 1, (delay, err)
            # on a quick host the run may have begun: then the run's summary follows (and no more)
            after = lines[stops[0] + 1:]
            assert not after or (re.match(r"# file:song.wav: \d+ hops, ", after[0]) and all(x.startswith("#") for x in after)), \
                (delay, err)


def test_a_stop_during_an_import_waits_until_the_import_is_over(tmp_path, monkeypatch):
    # C code that imports may print or drop an exception raised inside the import; the stop is
    # sent again until the module is whole, then raised in the code that imported it
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "t = time.monotonic()\n"
        "while time.monotonic() - t < 0.3:\n"        # bytecode runs: the handler is called here
        "    pass\n"
        "WHOLE = True\n")
    monkeypatch.syspath_prepend(tmp_path)
    handlers = stop_on_signals()
    try:
        with pytest.raises(Stopped) as e:
            import slow_module  # noqa: F401
            time.sleep(1.0)                                 # the stop is sent again within 0.05 s
        assert e.value.signum == signal.SIGTERM
        assert sys.modules["slow_module"].WHOLE is True
        assert stop_received().signum == signal.SIGTERM
    finally:
        restore(handlers)
        sys.modules.pop("slow_module", None)


def test_a_stop_that_code_swallowed_still_ends_classify(tmp_path, capsys, monkeypatch):
    # code under the engine that drops the Stopped (a __del__, a callback from C that prints it):
    # the run still ends at the next record, as a stop, with the rows before it
    from app.cli import main
    from app.runtime.engine import Engine
    real_hop, hops = Engine.hop, []

    def hop_that_swallows(self):
        hops.append(1)
        if len(hops) == 3:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)                             # the handler raises in here
            except KeyboardInterrupt:
                pass
        return real_hop(self)
    monkeypatch.setattr(Engine, "hop", hop_that_swallows)
    path = song(tmp_path, 10)
    code = main(["classify", str(path), "--csv", str(tmp_path / "r.csv")])
    err = capsys.readouterr().err
    assert code == 143 and "# stopped by SIGTERM" in err, err[-2000:]
    assert len(complete_rows(tmp_path / "r.csv")) == 2 and len(hops) == 3   # 40 hops in the file


def test_a_stop_that_a_weights_read_turned_into_its_own_error_ends_as_a_stop(tmp_path, capsys, monkeypatch):
    # safetensors' reads call back into Python: a stop that lands there comes back as the reader's
    # own error, which the loader reports as unreadable weights. The command ends as stopped, not
    # with that error; an unreadable file with no stop is still said as one
    import safetensors
    from app.cli import main
    from app.runtime.faults import Stopped
    real_open = safetensors.safe_open

    def open_that_converts(*args, **kw):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)                                 # the handler raises in here
        except Stopped:
            raise safetensors.SafetensorError("could not determine the tensor's storage") from None
        return real_open(*args, **kw)
    monkeypatch.setattr(safetensors, "safe_open", open_that_converts)
    path = song(tmp_path, 3)
    assert main(["classify", str(path), "--csv", str(tmp_path / "r.csv")]) == 143
    err = capsys.readouterr().err
    assert "# stopped by SIGTERM" in err and "error:" not in err, err[-2000:]

    def unreadable(*args, **kw):
        raise safetensors.SafetensorError("could not determine the tensor's storage")
    monkeypatch.setattr(safetensors, "safe_open", unreadable)
    assert main(["classify", str(path), "--csv", str(tmp_path / "r.csv")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: musicnn weights ") and "are unreadable (could not" in err[0]


def test_csv_rows_are_cut_back_to_the_last_whole_row_when_a_write_fails(tmp_path, monkeypatch):
    rows = CsvRows(str(tmp_path / "r.csv"))
    rows.write({"a": 1, "b": "x,y"})
    rows.write({"a": 2, "b": "z"})
    real = os.write

    def half(fd, data):                                  # a disk that fills up mid-row
        if len(data) > 3:
            real(fd, bytes(data[:3]))
            raise OSError(28, "No space left on device")
        return real(fd, data)
    monkeypatch.setattr(os, "write", half)
    with pytest.raises(OSError) as e:
        rows.write({"a": 3, "b": "a longer row"})
    rows.close()
    assert (tmp_path / "r.csv").read_bytes() == b'a,b\r\n1,"x,y"\r\n2,z\r\n' and rows.rows == 2
    assert resource_message(e.value, "r.csv") == "no space left on the device: r.csv"
    assert resource_message(OSError(2, "missing")) is None
    assert resource_message(OSError(28, "No space left on device", "/d/.m.pt.4242.tmp"),  # a temporary:
                            "x") == "no space left on the device: /d/m.pt"               # the file asked for
    assert exit_code(Stopped(signal.SIGTERM)) == 143 and exit_code(KeyboardInterrupt()) == 130


def test_a_second_run_on_the_same_output_refuses_at_once_and_a_stale_lock_is_taken_over(tmp_path):
    from app.runtime.output_lock import lock_path
    gtzan = tmp_path / "gtzan"
    gtzan.mkdir()
    for i, genre in enumerate(("blues", "rock")):
        write(gtzan / f"{genre}.00000.wav", tone(2.0, 22050, 220 * (i + 1)), 22050)
    out = tmp_path / "tokens.npz"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom app.runtime.output_lock import output_lock\n"
         "with output_lock(sys.argv[1], 'extract'):\n    print('held', flush=True)\n    time.sleep(120)\n", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        p = main_py("extract", "--gtzan", gtzan, "--out", out)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 1 and "Traceback" not in err, err[-2000:]
        assert f"error: {out} is being written by process {holder.pid} (extract); wait" in err
        assert not out.exists()
    finally:
        holder.kill()                                   # SIGKILL: its lock file stays behind
        holder.wait()
    assert lock_path(out).exists()
    p = main_py("extract", "--gtzan", gtzan, "--out", out)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    assert f"a stale lock of process {holder.pid} (extract) (not running) was taken over" in err
    assert out.exists() and not lock_path(out).exists()


def test_a_reader_that_closes_the_pipe_ends_the_run_like_a_stop():
    """`classify --jsonl | head -1`: the reader leaves; the run ends with its summary and verdict
    on stderr, exit 141 (128 + SIGPIPE, as a shell says it), no traceback."""
    p = main_py("classify", "--demo", "--jsonl", "--seconds", "60")
    first = p.stdout.readline()
    assert first.startswith("{"), p.communicate()[1][-2000:]
    p.stdout.close()                                     # as `head -1` exits
    err = p.stderr.read()
    p.wait(timeout=60)
    assert p.returncode == 141 and "Traceback" not in err, err[-2000:]
    assert "# stopped: the reader of the output closed it" in err and "# verdict over demo" in err


def test_a_lock_file_removed_while_a_run_takes_it_is_taken_again(tmp_path, monkeypatch):
    """The run before removes its lock file just as this one locks it: this run must lock the new
    file, or a third run would lock the new file too and two would write at once."""
    from app.runtime import output_lock as ol
    out = tmp_path / "tokens.npz"
    real_flock, removed = ol.fcntl.flock, []

    def flock_then_the_run_before_ends(fd, op):
        real_flock(fd, op)
        if not removed:
            removed.append(True)
            ol.lock_path(out).unlink()                   # as the finishing run unlinks it
    monkeypatch.setattr(ol.fcntl, "flock", flock_then_the_run_before_ends)
    with ol.output_lock(out, "extract"):
        held = os.stat(ol.lock_path(out)).st_ino
        third = os.open(ol.lock_path(out), os.O_RDWR)    # a third run, on the file now there
        with pytest.raises(BlockingIOError):
            real_flock(third, ol.fcntl.LOCK_EX | ol.fcntl.LOCK_NB)
        os.close(third)
    assert removed and held and not ol.lock_path(out).exists()
