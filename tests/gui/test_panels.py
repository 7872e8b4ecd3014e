"""The window's panels (offscreen): plots that compare (gaps, rolling median and band, aligned
axes, legend toggles, read-outs, ranking bars), the genre timeline, the docks' saved layout and
fit to a small screen, the agreement reference choice. Oracles: the engine's own step records."""
import numpy as np
import pytest
from PySide6.QtCore import QRect, Qt

from app.gui import docks
from app.gui.genre_panel import NAMED_RUN, runs
from app.gui.plot_kit import GENRE_COLOURS, log_ticks, model_pen
from app.gui.plot_kit import LogAxis, gapped, rolling_quantiles, short_number
from app.gui.ranking import bar_values
from app.gui.table import same_mode_run
from app.gui.ini import IniSettings
from app.gui.window import MainWindow, Options
from app.runtime.verdict import Smoother
from gui_helpers import WAIT_MS, wait_steps


# ---------------------------------------------------------------------- helpers, against numpy
def test_rolling_quantiles_equal_numpy_per_window_and_keep_gaps():
    rng = np.random.default_rng(0)
    x = rng.exponential(size=60)
    x[20:25] = np.nan                                   # the model was off: a gap
    q = rolling_quantiles(x, 7)
    for i in range(60):
        if np.isnan(x[i]):
            assert np.isnan(q[:, i]).all()
            continue
        window = x[max(0, i - 6):i + 1]
        np.testing.assert_allclose(q[:, i], np.nanpercentile(window, [10, 50, 90]))


def test_gapped_series_leave_missing_steps_as_nan():
    out = gapped(np.array([3, 4, 7]), np.array([1.0, 2.0, 3.0]), np.arange(2, 9))
    np.testing.assert_array_equal(np.isnan(out), [True, False, False, True, True, False, True])
    assert out[[1, 2, 5]].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("lo, hi", [(np.log10(0.2), np.log10(1.3)), (2.0, 5.5), (0.0, 9.0), (-1.0, 1.0)])
def test_log_axis_labels_never_crowd(qapp, lo, hi):
    axis = LogAxis("left")
    axis.setLogMode(False, True)
    for size in (60, 120, 400):
        (_, values), = axis.tickValues(lo, hi, size)
        assert 2 <= len(values) <= max(2, size // 14) or (hi - lo > 8 and size < 100)
        assert all(lo <= v <= hi for v in values)
        labels = axis.tickStrings(values, 1, 1)
        assert len(set(labels)) == len(labels)
    assert short_number(2e6) == "2M" and short_number(10_000) == "10k" and short_number(0.5) == "0.5"
    assert log_ticks(2.3, 6.0) == [(2, "100"), (3, "1k"), (4, "10k"), (5, "100k"), (6, "1M")]


def test_neighbouring_models_differ_in_dash_pattern_so_equal_costs_stay_visible(qapp):
    styles = [model_pen(i).style() for i in range(4)]
    assert len(set(styles)) == 4                       # two equal curves interleave their dashes


def test_runs_and_fitting_a_window_to_a_screen():
    assert runs(np.array([2, 2, 5, 5, 5, -1])) == [(0, 2, 2), (2, 5, 5), (5, 6, -1)]
    screen = QRect(0, 0, 1366, 740)
    assert docks.fitted(QRect(100, 200, 1500, 950), screen) == QRect(0, 0, 1366, 740)
    assert docks.fitted(QRect(900, 500, 800, 600), screen) == QRect(566, 140, 800, 600)


# ---------------------------------------------------------------------- the window
def test_cost_plots_compare_gaps_medians_aligned_axes_legend_readout_and_ranking(make_window, qtbot):
    w = make_window(source="demo", variants=("continual", "continual_nystrom"))
    wait_steps(qtbot, w, 12)
    w.variant_boxes["continual"].setChecked(False)              # off for a while, then on again
    qtbot.waitUntil(lambda: "continual" not in w.history[-1].models, timeout=WAIT_MS)
    wait_steps(qtbot, w, len(w.history) + 4)
    w.variant_boxes["continual"].setChecked(True)
    qtbot.waitUntil(lambda: "continual" in w.history[-1].models, timeout=WAIT_MS)
    wait_steps(qtbot, w, len(w.history) + 10)
    w.timer.stop()
    w.redraw()
    recent = list(w.recent)
    # the FLOPs line has a gap where the model was off, and equals the records elsewhere
    xs, ys = w.cost.curves["continual"].flops.getData()
    off = np.array(["continual" not in r.models for r in recent])
    assert off.sum() >= 4 and np.isnan(ys[off]).all() and np.isfinite(ys[~off]).all()
    # the latency line is the rolling median of the records, the band their p10-p90
    lat = np.array([r.models["continual_nystrom"].latency_ms for r in recent])
    _, med = w.cost.curves["continual_nystrom"].median.getData()
    i = len(recent) - 1
    window = lat[i - 19:i + 1]
    assert 10 ** med[-1] == pytest.approx(np.median(window), rel=1e-6)             # log axis
    assert 10 ** w.cost.curves["continual_nystrom"].hi.getData()[1][-1] == pytest.approx(np.percentile(window, 90))
    # the three time plots share one x range, also after the models are rebuilt
    w.window_box.setValue(12)
    w.sync_models(rebuild=True)
    w.timer.start(33)
    wait_steps(qtbot, w, len(w.history) + 4)
    qtbot.wait(100)
    ranges = [p.viewRange()[0] for p in (w.cost.flops_plot, w.cost.latency_plot, w.cost.front_plot)]
    assert ranges[0] == pytest.approx(ranges[1]) and ranges[0] == pytest.approx(ranges[2])
    # clicking a legend entry hides all of that model's curves, clicking again shows them
    sample = next(s for s, label in w.cost.legend.items if label.text == "continual")

    class Click:
        def button(self):
            return Qt.MouseButton.LeftButton

        def accept(self):
            pass
    sample.mouseClickEvent(Click())
    c = w.cost.curves["continual"]
    assert not c.median.isVisible() and not c.flops.isVisible() and not c.band.isVisible()
    sample.mouseClickEvent(Click())
    assert c.median.isVisible() and c.flops.isVisible()
    # the read-out names every model's values at a step, as recorded
    w.timer.stop()
    w.redraw()
    last = w.recent[-1]
    text = w.cost.readout_at(last.step)
    assert text.startswith(f"step {last.step}:")
    for name, m in last.models.items():
        assert f"{name} " in text and f"{m.flops['sda']:,} FLOPs" in text
    # ranking: fewest mean FLOPs on top, bars as long as the means (log10), latency in that order
    minute = list(w.recent)[-240:]
    values = bar_values(minute, list(last.models), "sda")
    assert w.ranking.order == sorted(values, key=lambda n: values[n][1])
    for name, (lat_mean, flops_mean) in values.items():
        run = same_mode_run(minute, name)
        assert flops_mean == pytest.approx(np.mean([m.flops["sda"] for m in run]))
        assert lat_mean == pytest.approx(np.mean([r.models[name].latency_ms for r in minute if name in r.models]))
    bars = w.ranking.items[w.ranking.latency_plot].opts
    assert list(bars["width"]) == pytest.approx([values[n][0] for n in w.ranking.order])


def test_genre_timeline_strips_are_each_steps_top_and_the_smoothed_top(make_window, qtbot):
    w = make_window(source="demo", variants=("continual_nystrom",))
    # the model runs from the hop after its build (on the engine's control thread) is done,
    # which on a busy host may be a few hops after the stream's first: the strips start there
    wait_steps(qtbot, w, 40, model="continual_nystrom")
    w.timer.stop()
    w.redraw()
    history = [r for r in w.history if "continual_nystrom" in r.models]
    assert [r.step for r in history] == list(range(history[0].step, history[-1].step + 1))
    image = w.genre.timeline.image                                  # (2 strips, steps, RGBA)
    assert image.shape[:2] == (2, history[-1].step - history[0].step + 1)
    smoother = Smoother(w.smooth_box.value())
    for k, r in enumerate(history):
        m = r.models["continual_nystrom"]
        smooth = smoother.update("continual_nystrom", m.probabilities)
        assert tuple(image[1, k]) == GENRE_COLOURS[int(np.argmax(m.probabilities))].getRgb()
        assert tuple(image[0, k]) == GENRE_COLOURS[int(np.argmax(smooth))].getRgb()
    named = [(a, b, g) for a, b, g in runs(np.array([int(np.argmax(s)) for s in
                                                     _smoothed(history, w.smooth_box.value())]))
             if b - a >= NAMED_RUN]
    shown = [t.textItem.toPlainText() for t in w.genre.names if t.isVisible()]
    classes = history[-1].models["continual_nystrom"].classes
    assert shown == [classes[g] for _, _, g in named] and shown
    t = history[10].audio_time
    assert w.genre.readout_at(t).startswith(f"{t:.2f} s: this step {history[10].models['continual_nystrom'].top[0]}")


def _smoothed(history, seconds):
    s = Smoother(seconds)
    return [s.update("m", r.models["continual_nystrom"].probabilities) for r in history]


def test_docks_fit_a_1366x768_screen_and_the_layout_is_remembered(make_window, qtbot, tmp_path):
    w = make_window(source="demo", start=False)
    hint = w.minimumSizeHint()
    assert hint.width() <= 1366 and hint.height() <= 700              # fits with a taskbar
    assert {a.text() for a in w.menuBar().actions()[0].menu().actions()} >= {
        "Controls", "Costs", "Comparison table", "Ranking", "Spectrogram", "Reset layout"}
    w.docks["Ranking"].hide()
    w.cost.kind_box.setCurrentIndex(w.cost.kind_box.findData("model"))
    w.resize(700, 500)
    w.save_settings()
    w2 = MainWindow(Options(random_vggish=0, autostart=False), w.settings)
    qtbot.addWidget(w2)
    assert w2.docks["Ranking"].isHidden() and not w2.docks["Costs"].isHidden()
    assert w2.cost.flops_kind == "model" and w.height() == 500
    screen = w2.screen().availableGeometry()
    assert w2.height() == 500 and screen.width() - 4 <= w2.width() <= screen.width() < w.width()   # fitted
    # without a saved geometry the window takes this (offscreen, 800 x 800) screen's area
    w3 = MainWindow(Options(random_vggish=0, autostart=False), IniSettings(tmp_path / "new.ini"))
    qtbot.addWidget(w3)
    assert screen.width() < 1500 and screen.contains(w3.frameGeometry())


def test_agreement_reference_is_a_choice_among_models_of_the_same_shape(make_window, qtbot):
    w = make_window(source="demo", variants=("regular", "continual", "nystrom"))
    wait_steps(qtbot, w, 6)
    box = w.table.reference_box
    qtbot.waitUntil(lambda: box.count() == 4, timeout=WAIT_MS)         # auto + the three models
    box.setCurrentIndex(box.findData("nystrom"))
    wait_steps(qtbot, w, len(w.history) + 1)
    w.timer.stop()
    w.redraw()
    recent = list(w.recent)[-240:]
    w.table.show_steps(recent)
    rows = {w.table.grid.item(r, 0).text(): w.table.grid.item(r, 3).text() for r in range(3)}
    same = [r for r in recent if {"continual", "nystrom"} <= set(r.models)]
    agree = sum(r.models["continual"].top[0] == r.models["nystrom"].top[0] for r in same)
    assert rows["nystrom"] == "reference"
    assert rows["continual"] == f"{100 * agree / len(same):.0f}% (nystrom)"
    assert rows["regular"].endswith("(nystrom)")
    w.save_settings()
    w2 = MainWindow(Options(random_vggish=0, autostart=False), w.settings)
    qtbot.addWidget(w2)
    assert w2.table.wanted == "nystrom"                                # taken again when it runs


def test_a_long_file_name_is_elided_and_never_squeezes_the_open_button(make_window, qtbot, tmp_path):
    w = make_window(source="demo", start=False)
    before = w.side.open_btn.width()
    long = tmp_path / ("a_very_long_recording_name_" * 8 + ".wav")
    w.set_file(str(long))
    qtbot.wait(50)
    assert "…" in w.file_label.text() and w.file_label.toolTip() == str(long)
    assert w.side.open_btn.width() == before and w.side.open_btn.text() == "Open file…"
