"""`bench --soak`: the real window with six models, its resident memory sampled, and the
window's export history packed and bounded in bytes (app/runtime/steplog.py)."""
from app.commands.bench import print_soak
from app.gui import bench
from app.gui.window import MainWindow


def test_soak_reports_memory_drops_and_delay_and_keeps_the_history_small(qapp, monkeypatch, capsys):
    monkeypatch.setattr(bench, "RSS_EVERY_S", 2.0)
    seen, windows = [], []
    original = MainWindow.close
    monkeypatch.setattr(MainWindow, "close", lambda w: (windows.append(w), original(w))[1])
    r = bench.gui(12, progress=lambda t, mb, dropped: seen.append((t, mb, dropped)))
    # the real-time source gives 4 hops per second of the run, each shown or dropped (how many
    # are dropped depends on this host's spare CPU: `bench --gui` measures it)
    assert r["models"] == 6 and r["hops"] >= 8 and r["hops"] + r["dropped_hops"] <= 4 * r["seconds"] + 2
    assert len(r["rss_mb"]) >= 6 and [t for t, _ in r["rss_mb"]] == sorted(t for t, _ in r["rss_mb"])
    assert all(300 < mb < 4000 for _, mb in r["rss_mb"])               # resident MB of this process
    # the engine process's, sampled while it runs (once it has streamed: torch and the models loaded)
    assert [t for t, _ in r["engine_rss_mb"]] == [t for t, _ in r["rss_mb"]]
    assert all(100 < mb < 4000 for t, mb in r["engine_rss_mb"] if t > 10), r["engine_rss_mb"]
    assert len(seen) >= 5 and seen[-1][2] == r["dropped_hops"]
    # the first hop arrived after Start, within the run; the suite keeps the push eager
    assert 0 < r["first_hop_s"] < r["seconds"] and r["push"] is None
    assert r["rss_growth_after_5min_mb"] is None is r["engine_rss_growth_after_5min_mb"]   # too short
    log = windows[0].history
    assert len(log) == r["hops"] and log.nbytes < 1000 * len(log)     # < 1 KB per hop with six models
    assert log[-1].mel is None and set(log[-1].models) == set(windows[0].recent[-1].models)
    print_soak(r)
    out = capsys.readouterr().out
    assert "window process resident memory:" in out and "engine process resident memory:" in out
    assert "run 10 minutes or more to see it" in out
