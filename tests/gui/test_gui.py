"""The desktop window, headless (QT_QPA_PLATFORM=offscreen), with real sources and the real engine;
and once under Xvfb as a real X11 window with a screenshot."""
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PySide6.QtCore import Qt
from PySide6.QtGui import QImage

from app.runtime.records import csv_row
from app.runtime.sources import SourceKind
from app.runtime.verdict import Tally, top_k
from app.gui.window import MainWindow, Options
from audio_helpers import tone, write
from gui_helpers import SPEED, WAIT_MS, wait_steps
from process_helpers import descendants, gone_within, name_of
from app.checkpoint import save_checkpoint
from models.transformer import ModelConfig, build_model

ROOT = Path(__file__).resolve().parents[2]


def test_window_runs_a_file_and_every_plot_gets_data(make_window, qtbot, music_file):
    w = make_window(source=f"file:{music_file}")
    wait_steps(qtbot, w, 12)
    qtbot.wait(100)
    last = w.history[-1]
    assert last.source == "file:music.wav" and set(last.models) == {"regular", "continual", "continual_nystrom"}
    assert set(w.history[0].models) == set(last.models)          # every model from the run's first hop
    focus = w.focus_box.currentText()
    heights = w.genre.bars.opts["width"]
    np.testing.assert_allclose(heights, w.history[-1].models[focus].probabilities, atol=0.05)
    assert abs(sum(heights) - 1) < 1e-3
    x, y = w.genre.history[0].getData()
    assert len(x) >= 10
    for name in last.models:
        xs, ys = w.cost.curves[name].flops.getData()
        assert len(xs) >= 10 and (ys > 0).all()
        assert len(w.cost.curves[name].median.getData()[0]) >= 10
    assert (w.spectrogram.data > -10).sum() > 25 * 64 * 8          # real log-mel frames arrived
    assert w.table.grid.rowCount() == 4 and w.table.grid.item(0, 8).text() == "UNTRAINED (random)"
    assert w.table.grid.item(3, 0).text() == "front end"                               # its own row
    assert w.table.grid.item(3, 8).text().startswith("RANDOM VGGish")
    assert int(w.table.grid.item(3, 5).text().split()[0].replace(",", "")) == last.frontend_flops > 0
    assert "RANDOM" in w.status["tokens"].text()
    assert f"dropped hops: {last.dropped_hops}" in w.status["run"].text()     # the source's own count
    assert "untrained" in w.top_label.text()
    # real-time pace at the chosen speed, on the source's clock: each hop is due 0.25 s / speed
    # after the one before, so the records' ready times step by that per hop shown or dropped,
    # however fast this host is (whether it keeps up is measured by `bench --gui`)
    assert w.speed == SPEED
    recent = list(w.history)[-9:]
    for a, b in zip(recent, recent[1:]):
        hops = (b.step - a.step) + (b.dropped_hops - a.dropped_hops)
        assert b.ready_time - a.ready_time == pytest.approx(0.25 / SPEED * hops, abs=1e-6)
        assert b.done_time >= b.ready_time
    # the speed changed live: from the engine's next hop, twice as fast (the last 9 of 24 new
    # steps: hops made before the change may still be on their way to the window)
    w.speed_box.setCurrentIndex(w.speed_box.findData(2 * SPEED))
    wait_steps(qtbot, w, len(w.history) + 24)
    recent = list(w.history)[-9:]
    for a, b in zip(recent, recent[1:]):
        hops = (b.step - a.step) + (b.dropped_hops - a.dropped_hops)
        assert b.ready_time - a.ready_time == pytest.approx(0.25 / (2 * SPEED) * hops, abs=1e-6)


def test_dropping_a_file_on_the_window_plays_it(make_window, qtbot, music_file):
    from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
    from PySide6.QtGui import QDropEvent
    w = make_window(source="demo", start=False)
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(music_file))])
    w.dropEvent(QDropEvent(QPointF(50, 50), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier))
    wait_steps(qtbot, w, 2)
    assert w.file_path == str(music_file) and w.history[-1].source == "file:music.wav"


def test_landmark_switch_changes_the_flops_curve_live(make_window, qtbot):
    w = make_window(source="demo", variants=("continual_nystrom",))
    wait_steps(qtbot, w, 20, model="continual_nystrom")       # it may join some hops after the first
    before = [r.models["continual_nystrom"].flops["sda"] for r in w.history if "continual_nystrom" in r.models][10:20]
    w.mode_fixed.setChecked(True)
    qtbot.waitUntil(lambda: w.history[-1].models["continual_nystrom"].landmark_mode == "fixed", timeout=WAIT_MS)
    switched_at = len(w.history)
    wait_steps(qtbot, w, switched_at + 10)
    qtbot.wait(100)
    after = [r.models["continual_nystrom"].flops["sda"] for r in list(w.history)[switched_at:switched_at + 10]]
    assert max(after) < max(before)                                  # no landmark-update spikes
    xs, ys = w.cost.curves["continual_nystrom"].flops.getData()
    assert 10 ** ys[-1] == pytest.approx(w.history[-1].models["continual_nystrom"].flops["sda"])   # log axis
    assert w.table.grid.item(0, 1).text() == "fixed"
    w.mode_continual.setChecked(True)
    qtbot.waitUntil(lambda: w.history[-1].models["continual_nystrom"].landmark_mode == "continual", timeout=WAIT_MS)


def test_table_flops_are_means_since_the_last_landmark_switch_with_min_max(make_window, qtbot):
    """The table's FLOPs are the mean over the steps since the model last changed landmark mode
    (with the min-max where they vary), not the last step: fixed landmarks no longer look dearer
    than continual ones, whose update spikes the last step hides."""
    w = make_window(source="demo", variants=("continual_nystrom",))
    name = "continual_nystrom"

    def table_now(warm_only=True):
        recent = list(w.history)
        w.table.show_steps(recent)            # same thread as the timer: no redraw in between
        run = []
        for r in reversed(recent):               # back to its last landmark switch, or to its join
            m = r.models.get(name)
            if m is None or m.landmark_mode != recent[-1].models[name].landmark_mode:
                break
            run.append(m)
        full = [m for m in run if m.warm]
        return w.table.grid.item(0, 4).text(), [m.flops["sda"] for m in (full if warm_only else run)]

    wait_steps(qtbot, w, 12)                   # the live k-means fit needs a window of tokens
    # and two steps past its warm-up (on a loaded host the model may join the stream some hops
    # after the first)
    qtbot.waitUntil(lambda: all(getattr(r.models.get(name), "warm", False) for r in list(w.history)[-2:]),
                    timeout=WAIT_MS)
    cell, run = table_now()                    # warm-up steps (n = 8) are not in the mean
    assert cell == expected(run) and len(run) < len(table_now(warm_only=False)[1])
    w.mode_fixed.setChecked(True)
    qtbot.waitUntil(lambda: bool(w.history) and w.history[-1].models[name].landmark_mode == "fixed",
                    timeout=WAIT_MS)
    wait_steps(qtbot, w, len(w.history) + 6)
    cell, run = table_now()
    # the fixed steps since the switch (a step's FLOPs vary with its data: a running-max rescale
    # adds to some steps and not others, so only the mean and the range are checked)
    assert cell == expected(run) and len(run) >= 6
    w.mode_continual.setChecked(True)
    qtbot.waitUntil(lambda: w.history[-1].models[name].landmark_mode == "continual", timeout=WAIT_MS)
    wait_steps(qtbot, w, len(w.history) + 13)              # three landmark cycles (n = 8, m = 2)
    cell, run = table_now()
    assert min(run) < max(run) and cell == expected(run)


def expected(run):
    mean = round(sum(run) / len(run))
    return f"{mean:,}" if min(run) == max(run) else f"{mean:,} ({min(run):,}-{max(run):,})"


def test_the_window_says_when_a_run_ends_and_what_a_control_did(make_window, qtbot, tmp_path):
    short = write(tmp_path / "short.wav", tone(1.5, 22050, 440), 22050)
    w = make_window(source=f"file:{short}", variants=("continual_nystrom",), start=False)
    w.loop_box.setChecked(False)
    w.start()
    # the file ends (no loop): Pause is disabled, the status bar and the header say so
    qtbot.waitUntil(lambda: "Finished" in w.statusBar().currentMessage(), timeout=WAIT_MS)
    assert not w.pause_btn.isEnabled() and w.focus_label.text().endswith("· finished")
    assert f"after {w.history[-1].step + 1} hops" in w.statusBar().currentMessage()
    # the file's verdict for the focused model, as the records tally it
    v = {v.name: v for v in Tally.of(w.history).verdicts()}["continual_nystrom"]
    assert w.header.verdict.isVisible()
    assert f"<b>{v.genre}</b>, on top in {100 * v.share:.0f}% of {v.steps} steps" in w.header.verdict.text()
    # the big label: the smoothed probabilities (5 s by default), then the two runners-up
    (genre, p), *rest = top_k(w.history[-1].models["continual_nystrom"].classes,
                              w.header.smoother.state["continual_nystrom"])
    assert w.top_label.text().startswith(f"{genre}  {100 * p:.0f}%")
    assert w.header.runners_up.text().strip() == "then " + ", ".join(f"{g} {100 * q:.0f}%" for g, q in rest)
    assert w.header.smoother.seconds == w.smooth_box.value() == 5.0
    # a new run enables Pause again and clears the mark
    w.set_source_kind(SourceKind.DEMO)
    w.start()
    wait_steps(qtbot, w, 12)
    assert w.pause_btn.isEnabled() and "finished" not in w.focus_label.text()
    assert not w.header.verdict.isVisible()
    w.smooth_box.setValue(0)                             # no smoothing: the raw newest step
    qtbot.waitUntil(lambda: w.top_label.text().startswith(
        "{}  {:.0f}%".format(w.history[-1].models["continual_nystrom"].top[0],
                             100 * w.history[-1].models["continual_nystrom"].top[1])), timeout=WAIT_MS)
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow, timeout=WAIT_MS)
    qtbot.keyClick(w, Qt.Key_P, Qt.ControlModifier)      # the pause shortcut, both ways
    assert w.paused and w.pause_btn.text() == "Resume"
    qtbot.keyClick(w, Qt.Key_P, Qt.ControlModifier)
    assert not w.paused and w.pause_btn.text() == "Pause"
    # what a control did reaches the status bar (here the live k-means fit)
    w.mode_fixed.setChecked(True)
    qtbot.waitUntil(lambda: "fixed landmarks" in w.statusBar().currentMessage(), timeout=WAIT_MS)
    assert "k-means" in w.statusBar().currentMessage()
    # every variant unticked: no stale genre on screen
    for box in w.variant_boxes.values():
        box.setChecked(False)
    qtbot.waitUntil(lambda: w.top_label.text() == "—", timeout=WAIT_MS)
    assert w.focus_label.text().startswith("no model running")
    w.stop()
    qtbot.waitUntil(lambda: "Stopped" in w.statusBar().currentMessage(), timeout=WAIT_MS)
    assert not w.pause_btn.isEnabled() and w.focus_label.text().endswith("· stopped")


def test_models_are_added_and_removed_mid_stream(make_window, qtbot):
    w = make_window(source="demo", variants=("continual",))
    wait_steps(qtbot, w, 4)
    w.variant_boxes["nystrom"].setChecked(True)
    qtbot.waitUntil(lambda: "nystrom" in w.history[-1].models, timeout=WAIT_MS)
    w.variant_boxes["continual"].setChecked(False)
    qtbot.waitUntil(lambda: "continual" not in w.history[-1].models, timeout=WAIT_MS)
    steps = [r.step for r in w.history]
    assert steps == list(range(steps[0], steps[0] + len(steps)))     # the stream never restarted
    qtbot.wait(200)
    assert w.table.grid.rowCount() == 2 and w.table.grid.item(0, 0).text() == "nystrom"
    assert "continual" not in w.cost.curves
    wait_steps(qtbot, w, len(w.history) + 9)               # the window (n = 8) is full
    full, clicked = w.history[-1].models["nystrom"].flops["sda"], w.history[-1].step
    w.reset_btn.click()

    def reset():        # the hop that says it (a busy host may hand the window later hops with it)
        return next((r for r in list(w.history) if r.step > clicked and any("reset all models" in e for e in r.events)),
                    None)
    qtbot.waitUntil(lambda: reset() is not None, timeout=WAIT_MS)
    assert reset().models["nystrom"].flops["sda"] < full / 4     # recomputes a 1-token window again


def test_export_csv_rows_match_the_engine_records(make_window, qtbot, tmp_path):
    w = make_window(source="demo")
    wait_steps(qtbot, w, 6)
    w.stop()
    assert w.export_csv(str(tmp_path / "steps")) == len(w.history)     # as typed in a save dialog
    out = tmp_path / "steps.csv"                                        # the suffix added
    assert f"Exported {len(w.history)} steps to {out}" in w.statusBar().currentMessage()
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(w.history)
    for row, record in zip(rows, w.history):
        expected = csv_row(record)
        assert {k: str(v) for k, v in expected.items()} == {k: row[k] for k in expected}
    assert {"regular.landmark_mode", "continual_nystrom.landmark_mode", "events", "frontend"} <= set(rows[0])
    summary = json.loads((tmp_path / "steps.session.json").read_text())
    assert summary["source"] == "demo" and summary["random_frontend"] is True
    assert summary["steps"] == [w.history[0].step, w.history[-1].step]
    assert set(summary["models"]) == set(w.history[-1].models)
    assert summary["models"]["continual"]["weights"] == "UNTRAINED (random)"
    v = {v.name: v for v in Tally.of(w.history).verdicts()}["continual"]     # classify's verdict
    assert (summary["models"]["continual"]["top_genre"], summary["models"]["continual"]["steps"]) == (v.genre, v.steps)
    assert w.export_png(str(tmp_path / "plots")) and (tmp_path / "plots.png").stat().st_size > 10000
    image = QImage(str(tmp_path / "plots.png"))
    panels = w.genre.height() + w.cost.height() + w.ranking.height()          # the panels, stacked
    assert image.height() > panels and image.width() >= w.cost.width()        # and the caption strip
    assert (tmp_path / "plots.session.json").exists()
    # a folder that does not exist: a message in the window, nothing raised, nothing written
    assert w.export_csv(str(tmp_path / "missing" / "x.csv")) == 0
    assert "Could not export" in w.banner.text() and not (tmp_path / "missing").exists()


def test_exports_onto_a_full_disk_say_so_and_leave_no_part_of_a_file(make_window, qtbot, small_disk):
    mount, fill = small_disk
    w = make_window(source="demo")
    wait_steps(qtbot, w, 6)
    w.stop()
    fill(3000)                                   # room for less than the CSV and the PNG
    assert w.export_csv(str(mount / "steps.csv")) == 0
    assert w.banner.text() == f"Could not export: no space left on the device: {mount / 'steps.csv'}"
    assert not w.export_png(str(mount / "plots.png"))
    assert w.banner.text() == f"Could not export: no space left on the device: {mount / 'plots.png'}"
    assert sorted(os.listdir(mount)) == ["filler"]          # no part of a file, no temporary
    (mount / "filler").unlink()
    assert w.export_csv(str(mount / "steps.csv")) == len(w.history)   # room again: it works


def test_errors_show_a_message_and_the_app_stays_usable(make_window, qtbot, tmp_path):
    w = make_window(source=f"file:{tmp_path / 'missing.wav'}")
    qtbot.waitUntil(lambda: w.banner.isVisible(), timeout=WAIT_MS)
    assert "not found" in w.banner.text() and "Choose another file" in w.banner.text()
    # a checkpoint for other tokens (musicnn, 50-d) is refused with what to do
    model = build_model(ModelConfig(variant="continual", in_dim=50, d_model=32, heads=4, ff_dim=64, window=29))
    save_checkpoint(model, tmp_path / "musicnn.pt", classes=[f"genre{i}" for i in range(10)])
    assert not w.load_checkpoint(str(tmp_path / "musicnn.pt"))
    assert "trained on musicnn tokens" in w.banner.text()
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert not w.load_checkpoint(str(tmp_path / "junk.pt"))
    assert "not a readable checkpoint" in w.banner.text()
    # the microphone without any device (none here unless a JACK server runs)
    w.source_kind.setCurrentIndex(1)
    w.device_box.setEditable(True)
    w.device_box.setCurrentText("no such device 123")
    w.banner.hide()
    w.start()
    qtbot.waitUntil(lambda: w.banner.isVisible(), timeout=WAIT_MS)
    assert "device" in w.banner.text().lower()
    # still usable: the demo signal runs
    w.source_kind.setCurrentIndex(0)
    w.start()
    wait_steps(qtbot, w, 3)


def test_trained_checkpoint_runs_beside_untrained_models(make_window, qtbot, tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(variant="continual_nystrom", window=8, num_landmarks=2))
    save_checkpoint(model, tmp_path / "cn.pt", classes=list(__import__("audio.gtzan").gtzan.GENRES))
    w = make_window(source="demo", variants=("continual",), checkpoints=[str(tmp_path / "cn.pt")])
    wait_steps(qtbot, w, 3)
    last = w.history[-1]
    assert {n: not m.trained for n, m in last.models.items()} == {"continual": True, "continual_nystrom [cn]": False}
    # trained, but fed RANDOM VGGish tokens: neither the table nor the big label calls it good
    qtbot.waitUntil(lambda: w.table.grid.rowCount() == 3 and w.focus_box.currentText() == "continual_nystrom [cn]",
                    timeout=WAIT_MS)
    rows = {w.table.grid.item(r, 0).text(): w.table.grid.item(r, 8).text() for r in range(2)}
    assert rows == {"continual": "UNTRAINED (random)",
                    "continual_nystrom [cn]": "trained, on RANDOM tokens: not meaningful"}
    assert "RANDOM front end: not meaningful" in w.top_label.text()


def test_window_starts_with_the_shipped_trained_models_on_musicnn(make_window, qtbot, music_file, tmp_path,
                                                                monkeypatch):
    """Defaults (no VGGish option): the musicnn front end and every shipped checkpoint, trained,
    each fed every 4th hop; nothing untrained; the spectrogram shows 96 musicnn bands. The
    front-end plot's title says how the musicnn push runs: here, compiling on, eager because a
    build failed before (its .failed file, for the engine process's torch threads)."""
    from app.gui.window import ENGINE_THREADS
    from audio.musicnn import build_musicnn
    from audio.musicnn.graph import package_key
    _, checksum = build_musicnn("MSD_musicnn")
    (tmp_path / f"{package_key('MSD_musicnn', checksum, 0, ENGINE_THREADS)}.failed").write_text("no compiler here\n")
    monkeypatch.setenv("NYSTREAM_PUSH_CACHE", str(tmp_path))
    monkeypatch.setenv("NYSTREAM_COMPILED_PUSH", "1")
    w = make_window(source=f"file:{music_file}", variants=None, random_vggish=None)
    wait_steps(qtbot, w, 6)
    qtbot.wait(100)
    assert w.cost.front_plot.titleLabel.text.endswith("per hop (eager)")
    assert w.cost.push == "eager: no compiler here" and w.cost.front_plot.toolTip() == w.cost.push
    last = w.history[-1]
    assert w.frontend_box.currentData() == "musicnn" and last.frontend.startswith("musicnn")
    assert set(last.models) == {"regular", "continual", "nystrom", "continual_nystrom",
                                       "continual_nystrom/fixed"}
    assert all(m.trained for m in last.models.values()) and {m.spacing for m in last.models.values()} == {4}
    assert "untrained" not in w.top_label.text() and w.spectrogram.data.shape[0] == 96
    assert all(w.table.grid.item(r, 8).text() == "trained" for r in range(5))
    # agreement: every trained model is compared with the trained `regular` checkpoint
    column = {w.table.grid.item(r, 0).text(): w.table.grid.item(r, 3).text() for r in range(5)}
    assert column["regular"] == "—"
    assert all(column[n].endswith("% (regular)") for n in column if n != "regular"), column
    # unticking a variant removes its trained model(s); re-ticking brings them back, trained
    w.variant_boxes["continual_nystrom"].setChecked(False)
    qtbot.waitUntil(lambda: "continual_nystrom/fixed" not in w.history[-1].models, timeout=WAIT_MS)
    w.variant_boxes["continual_nystrom"].setChecked(True)
    qtbot.waitUntil(lambda: "continual_nystrom/fixed" in w.history[-1].models, timeout=WAIT_MS)
    assert all(m.trained for m in w.history[-1].models.values())
    # switching the front end restarts the stream on VGGish tokens: no shipped models there
    w.options.random_vggish = 0
    w.frontend_box.setCurrentIndex(w.frontend_box.findData("vggish"))
    w.start()
    qtbot.waitUntil(lambda: bool(w.history) and w.history[-1].frontend.startswith("RANDOM VGGish"),
                    timeout=WAIT_MS)
    assert not any(m.trained for m in w.history[-1].models.values())
    assert w.cost.push is None and w.cost.front_plot.titleLabel.text == "Front end latency per hop"


def test_the_engine_process_is_ready_before_start_and_says_how_the_models_step(make_window, qtbot):
    """Opened, the window starts its engine process, which builds the front end and loads the
    compiled kernels (in the cache: tests/conftest.py) while nobody has pressed Start; Start then
    runs on that process, and the models' steady steps are compiled from its first hop."""
    w = make_window(source="demo", start=False)
    process = w.engine.process
    assert process.is_alive() and not w.running
    qtbot.waitUntil(lambda: w.prepared_s is not None, timeout=120_000)
    w.start()
    wait_steps(qtbot, w, 2)
    assert w.engine.process is process and w.kernels == "compiled (numba)"


def test_closing_ends_the_engine_process_and_every_thread(make_window, qtbot):
    import threading
    w = make_window(source="demo")
    wait_steps(qtbot, w, 2)
    process = w.engine.process
    t0 = time.monotonic()
    w.close()
    assert time.monotonic() - t0 < 3.0          # asked to exit, else terminated after 2 s
    assert not process.is_alive() and process.exitcode == 0
    assert not [t for t in threading.enumerate() if t.name.startswith(("nystream", "engine"))]


def test_a_killed_engine_is_said_in_one_line_what_was_drawn_stays_and_start_runs_a_fresh_one(make_window, qtbot,
                                                                                              tmp_path):
    w = make_window(source="demo")
    wait_steps(qtbot, w, 3)
    pid = w.engine.process.pid
    os.kill(pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: not w.running, timeout=WAIT_MS)
    kept = len(w.history)
    assert kept >= 3 and w.engine is None
    assert w.header.banner.text().startswith("the engine process was killed by SIGKILL")
    assert "\n" not in w.header.banner.text() and "Start runs a fresh engine" in w.header.banner.text()
    assert "Ended by an error" in w.statusBar().currentMessage() and not w.pause_btn.isEnabled()
    assert w.export_csv(str(tmp_path / "kept.csv")) == kept          # and it can still be exported
    w.start()
    wait_steps(qtbot, w, 2)
    assert w.engine.process.pid != pid and w.engine.alive()


def test_a_window_killed_with_sigkill_leaves_no_engine_process_behind(tmp_path):
    """The engine process (named nystream-engine) and every other process the window started
    end with it."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    gui = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "gui", "--source", "demo",
                            "--settings", str(tmp_path / "s.ini"), "--quit-after", "120"],
                           env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while "nystream-engine" not in [name_of(p) for p in descendants(gui.pid)]:
            assert time.monotonic() - t0 < 60 and gui.poll() is None, "no engine process started"
            time.sleep(0.1)
        below = descendants(gui.pid)
        time.sleep(1.0)
        gui.kill()
        gui.wait()
        left = [(p, name_of(p)) for p in below if not gone_within(p, 10)]
        assert not left, f"processes outlived their window: {left}"
    finally:
        gui.kill()


def test_qt_binding_keeps_none_alive(qtbot):
    """PySide6 6.12.0 drops a reference to None on each call returning None, which kills a long
    live session on Python 3.11 (pyproject.toml excludes it); this guards the installed version."""
    from PySide6.QtWidgets import QLabel
    label = QLabel()
    qtbot.addWidget(label)
    before = sys.getrefcount(None)
    for _ in range(5000):
        label.setText("x")
    assert sys.getrefcount(None) - before > -100


def test_settings_persist_between_runs(make_window, qtbot, music_file):
    w = make_window(source=f"file:{music_file}", variants=("nystrom",), n=16, start=False)
    w.layers_box.setValue(2)
    w.save_settings()
    w2 = MainWindow(Options(random_vggish=0, autostart=False), w.settings)
    qtbot.addWidget(w2)
    assert w2.file_path == str(music_file) and w2.source_kind.currentIndex() == 2
    assert [v for v, b in w2.variant_boxes.items() if b.isChecked()] == ["nystrom"]
    assert (w2.window_box.value(), w2.layers_box.value(), w2.speed) == (16, 2, SPEED)


@pytest.mark.skipif(shutil.which("Xvfb") is None, reason="Xvfb not installed (scripts/system-deps.sh --test)")
def test_real_window_under_xvfb_saves_a_screenshot(tmp_path):
    display = ":%d" % (90 + os.getpid() % 50)
    xvfb = subprocess.Popen(["Xvfb", display, "-screen", "0", "1366x768x24", "-nolisten", "tcp"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        env = {k: v for k, v in os.environ.items() if k != "QT_QPA_PLATFORM"}
        env["DISPLAY"] = display
        shot = tmp_path / "window.png"
        r = subprocess.run([sys.executable, str(ROOT / "main.py"), "gui", "--source", "demo", "--random-vggish",
                            "--speed", "2", "--settings", str(tmp_path / "s.ini"), "--screenshot", str(shot),
                            "--quit-after", "6"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        from PySide6.QtGui import QImage
        img = QImage(str(shot))
        assert (img.width(), img.height()) == (1366, 768)               # the whole small screen
        colours = {img.pixel(x, y) for x in range(0, 1366, 25) for y in range(0, 768, 25)}
        assert len(colours) > 20                      # a drawn window, not a blank frame
        assert "speed=2" in (tmp_path / "s.ini").read_text()       # --speed played, and was kept
    finally:
        xvfb.terminate()
        xvfb.wait(5)



def test_agreement_column_with_two_blocks_and_an_untrained_regular_beside_a_trained_one(
        make_window, qtbot, music_file):
    """The reference of each model is a running `regular` of the same blocks and weights status:
    2-block models against `regular 2-block` (exact variants agree 100 %), and a trained
    checkpoint against the trained `regular`, never the untrained one."""
    w = make_window(source=f"file:{music_file}", variants=("regular", "continual"), start=False)
    w.layers_box.setValue(2)
    w.start()
    wait_steps(qtbot, w, 6)
    qtbot.wait(100)
    rows = {w.table.grid.item(r, 0).text(): w.table.grid.item(r, 3).text() for r in range(w.table.grid.rowCount() - 1)}
    assert set(rows) == {"regular 2-block", "continual 2-block"}
    assert rows["continual 2-block"] == "100% (regular 2-block)"
    from app.gui.table import agreement
    from app.runtime.records import ModelStep, StepResult, reference_for

    def step(variant, trained, top):
        probs = [0.0] * 10
        probs[top] = 1.0
        return ModelStep(probs, list(range(10)), {}, 0.0, 0, trained, None, False, True, 4, variant, 1, 29)
    models = {"regular (untrained)": step("regular", False, 1), "regular": step("regular", True, 2),
              "continual": step("continual", True, 2)}
    assert reference_for("continual", models) == "regular"
    r = StepResult(0, 0.25, "demo", "musicnn", models, {"frontend": 1.0})
    assert agreement([r, r], "continual") == "100% (regular)"


def test_frames_redraw_the_plots_per_hop_and_the_ranking_and_table_once_a_second(make_window, qtbot):
    w = make_window(source="demo", start=False, speed=1.0)
    w.slow_panels_s = 1.0                        # the window's own setting
    w.start()
    wait_steps(qtbot, w, 12)
    t0, drawn = time.monotonic(), {k: len(v) for k, v in w.panel_ms.items()}
    hops = len(w.history)
    wait_steps(qtbot, w, hops + 12)
    seconds = time.monotonic() - t0
    frames = len(w.frame_ms)
    new = {k: len(v) - drawn[k] for k, v in w.panel_ms.items()}
    assert new["genre"] == new["cost"] >= 6           # a frame per arrival of new hops (4 a second)
    assert 1 <= new["ranking"] <= seconds + 1 and 1 <= new["table"] <= seconds + 1
    assert new["spectrogram"] == 0                    # a tab behind the table: not drawn
    # a drawing frame's CPU is recorded at the next tick: the newest may not be yet
    assert w.timer.interval() == 50 and len(w.frame_cpu_ms) in (frames - 1, frames)


def test_a_settings_file_with_bad_values_never_stops_the_window(make_window, qtbot, tmp_path):
    """Every value of the settings file is validated: a bad one is replaced by its default, the
    notice above the plots names its key (whole, until dismissed), unknown keys and unquoted
    lists are named too, the window starts, and the next save writes valid values back."""
    (tmp_path / "settings.ini").write_text(
        "[source]\nkind=tape\nloop=maybe\nspeed=3\nfile=/a,b.wav\n[models]\nlayers=abc\nwindow=nan\nlandmarks=-3\n"
        "variants=regular,bogus\n[view]\nsmoothing_s=fast\n[cost]\nflops_kind=gigaflops\n[window]\n"
        "geometry=not-bytes\nstate=1\n[General]\ncompute=tpu\nfrontend=wav2vec\ncolour=blue\n")
    w = make_window(source=None, variants=None, start=False, random_vggish=None)
    line = w.notice.text()
    for key in ("source/kind", "source/loop", "source/speed", "source/file", "models/layers", "models/window",
                "models/landmarks", "models/variants", "view/smoothing_s", "cost/flops_kind",
                "window/geometry", "window/state", "compute", "frontend", "colour"):
        assert key in line, key
    assert line.startswith("Settings file: ") and "\n" not in line
    assert w.notice.label.textFormat() == Qt.PlainText and w.notice.label.wordWrap()
    assert (w.layers_box.value(), w.smooth_box.value(), w.cost.flops_kind) == (1, 5.0, "sda")
    assert w.source_kind.currentData() == "demo" and w.frontend_name == "musicnn" and w.device == "cpu"
    assert [v for v, b in w.variant_boxes.items() if b.isChecked()] == ["regular"]
    w.start()
    wait_steps(qtbot, w, 2)
    w.statusBar().showMessage("added nystrom")                  # other news does not replace it
    assert w.notice.text() == line
    w.notice.dismiss.click()
    assert w.notice.text() == ""
    w.close()
    again = make_window(source=None, variants=None, start=False, random_vggish=None)
    assert again.notice.text() == ""                              # the defaults were written back
    assert again.layers_box.value() == 1 and again.loop_box.isChecked()


def test_a_settings_value_that_would_unpickle_is_refused_unread(make_window, tmp_path):
    """A ``@Variant(PySide::PyObjectWrapper ...)`` value is never deserialised: its key is named,
    the valid keys are kept, and the payload does not run. The oracle: the same file read by
    QSettings, in another process, does run it."""
    from hostile_files import pickling_settings
    marker = tmp_path / "ran"
    pickling_settings(tmp_path / "settings.ini", marker, "[models]\nlayers=2\n", "models/window")
    w = make_window(source=None, variants=None, start=False, random_vggish=None)
    line = w.notice.text()
    assert "models/window" in line and "serialised object" in line
    assert w.layers_box.value() == 2                  # the valid key of the same section is kept
    assert not marker.exists()
    w.save_settings()                                 # the write does not read it either
    assert not marker.exists() and "PyObjectWrapper" not in (tmp_path / "settings.ini").read_text()
    probe = "from PySide6.QtCore import QSettings; QSettings(%r, QSettings.IniFormat).value('models/layers')"
    pickling_settings(tmp_path / "qt.ini", marker, "[models]\nlayers=2\n", "models/window")
    subprocess.run([sys.executable, "-c", probe % str(tmp_path / "qt.ini")], capture_output=True, timeout=60)
    assert marker.exists()                            # QSettings would have run it


def test_an_exported_step_runs_in_the_window_beside_its_torch_model(make_window, qtbot, tmp_path):
    """`--checkpoint OUT.onnx`: the engine process runs the ONNX Runtime step next to the shipped
    torch model it was exported from; the same tokens give the same probabilities (float32)."""
    from app.checkpoint import load_checkpoint
    from app.offline.onnx_export import export_onnx
    ckpt = Path(__file__).resolve().parents[2] / "assets" / "models" / "musicnn-continual_nystrom-fixed.pt"
    model, payload = load_checkpoint(ckpt, fused=False)
    export_onnx(model, tmp_path / "m.onnx", classes=payload["classes"], frontend=payload["frontend"])
    w = make_window(source="demo", variants=("continual_nystrom",), random_vggish=None,
                    checkpoints=[str(tmp_path / "m.onnx")])
    name = "onnx:continual_nystrom/fixed [m]"
    wait_steps(qtbot, w, 4, model=name)          # the export joins once loaded (seconds on a busy host)
    for r in list(w.history)[-4:]:
        exported, torch_model = r.models[name], r.models["continual_nystrom/fixed"]
        assert exported.trained and exported.flops["sda"] > 0
        assert np.abs(np.subtract(exported.probabilities, torch_model.probabilities)).max() < 1e-4
    assert not w.load_checkpoint(str(tmp_path / "missing.onnx"))
    assert "ONNX model not found" in w.banner.text()


def test_names_from_files_show_as_plain_text(make_window):
    """Class and model names come from files: every label of the window shows them as text, the
    one rich-text label (the verdict) escapes them, and the cost legend too."""
    from PySide6.QtWidgets import QLabel

    from app.runtime.records import ModelStep, StepResult
    w = make_window(source=None, variants=None, start=False, random_vggish=None)
    labels = w.findChildren(QLabel)
    assert labels and all(lb.textFormat() == Qt.PlainText for lb in labels if lb is not w.header.verdict)
    name = "<img src=x onerror=alert(1)>"
    step = ModelStep(probabilities=[0.9, 0.1], classes=[name, "pop"], flops={"sda": 1}, latency_ms=0.1,
                     state_bytes=0, trained=True, landmark_mode=None, landmark_update=False, warm=True,
                     spacing=1, variant="continual", layers=1, window=8)
    history = [StepResult(i, 0.25 * (i + 1), "demo", "musicnn", {"m<b>": step},
                          {"frontend": 1.0, "mel": 0.5, "network": 0.5, "control": 0.0}) for i in range(4)]
    w.header.show_verdict(history, "m<b>")
    text = w.header.verdict.text()
    assert "&lt;img src=x" in text and "<img" not in text and "m&lt;b&gt;" in text


@pytest.mark.parametrize("count", [3, 40])
def test_a_checkpoint_of_its_own_classes_shows_their_names(make_window, qtbot, tmp_path, count):
    """A model trained on a user's own classes (`extract --folders`): the bars, the history and
    the big label name its classes; past MAX_BARS classes the bars hold the most probable ones."""
    from app.gui.genre_panel import MAX_BARS
    from audio.frontends import build_frontend, frontend_metadata
    classes = [f"class {i}" for i in range(count)]
    model = build_model(ModelConfig(variant="continual", window=8, in_dim=50, num_classes=count), seed=0)
    save_checkpoint(model, tmp_path / "own.pt", classes=classes, frontend=frontend_metadata(build_frontend("musicnn")))
    w = make_window(source="demo", variants=(), checkpoints=[str(tmp_path / "own.pt")], random_vggish=None)
    wait_steps(qtbot, w, 3)
    m = w.history[-1].models["continual [own]"]
    assert list(m.classes) == classes and len(m.probabilities) == count
    qtbot.waitUntil(lambda: w.focus_box.currentText() == "continual [own]", timeout=WAIT_MS)
    wait_steps(qtbot, w, 6)
    panel = w.genre
    recent = list(w.recent)                            # (the engine's reader adds steps meanwhile)
    panel.redraw(recent, "continual [own]")            # drawn here, from the newest step
    p = np.array(recent[-1].models["continual [own]"].probabilities)
    drawn = np.sort(np.argsort(-p)[:MAX_BARS])        # every class up to MAX_BARS, else the most probable
    ticks = [name for _, name in panel.bars_plot.getAxis("left")._tickLevels[0]]
    assert ticks == [classes[i] for i in drawn] and len(drawn) == min(count, MAX_BARS)
    np.testing.assert_array_equal(panel.bars.opts["width"], p[drawn])
    np.testing.assert_array_equal(panel.bars.opts["y"], np.arange(len(drawn)))
    curves = [c.getData() for c in panel.history]
    assert [y is not None and np.isfinite(y).any() for _, y in curves] == [j < len(drawn) for j in range(MAX_BARS)]
    # each drawn point is its step's probability (matched by audio time: on a busy host pyqtgraph
    # may still hand back a frame's data from before the redraw above)
    at = {r.audio_time: r.models["continual [own]"].probabilities for r in recent}
    (xs, ys), first = curves[0], panel.drawn[1][0]
    assert len(xs) >= 5 and all(y == at[x][first] for x, y in zip(xs, ys) if np.isfinite(y))
    assert w.top_label.text().startswith("class ")
    w.grab()                     # drawing the panels raises nothing
