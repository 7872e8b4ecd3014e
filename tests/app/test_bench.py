"""`bench` measures what it names: rows filtered by --only, fused and torch paths of one variant
with the same FLOPs per step (one set of formulas, the same steps), ratios taken in one run."""
import json

from app.offline import bench


def test_bench_only_rows_fused_and_torch_paths_count_the_same_flops(tmp_path):
    out = tmp_path / "bench.md"
    # 10 steps: the least a row times whatever its budget, so every row's FLOP mean is over the
    # same steps on any host (the budget only bounds the paired speed-up timing)
    rows = bench.run(windows=(12,), steps=10, budget_s=0.2, out=out, only="continual_nystrom/fixed")
    names = [r.what for r in rows]
    assert names and all("continual_nystrom/fixed" in w for w in names), names
    assert {"SDA continual_nystrom/fixed (torch)", "SDA continual_nystrom/fixed (fused)",
            "model 2-block continual_nystrom/fixed (fused)"} <= set(names)
    by = {r.what: r for r in rows}
    for w in names:
        if w.endswith(" (fused)"):   # means over the same timed steps of the same stream
            assert by[w].flops == by[w.replace("(fused)", "(torch)")].flops, w
        assert by[w].median_us > 0 and by[w].flops > 0
        if w.startswith("model"):    # speed-ups paired: both timed alternately in this run
            assert by[w].extra["vs_recompute"] > 0, w
            assert ("vs_torch_path" in by[w].extra) == w.endswith(" (fused)"), w
    text = out.read_text()
    assert "fused vs torch path" in text and "Audio front end" not in text
    assert len(json.loads(out.with_suffix(".json").read_text())) == len(rows)


def test_paired_medians_time_each_function_in_alternating_blocks():
    import time
    from app.offline.bench_timing import paired_medians
    calls = []

    def fast():
        calls.append("a")

    def slow():
        calls.append("b")
        time.sleep(0.002)

    a, b = paired_medians(fast, slow, budget_s=0.05, block_a=5, block_b=1)
    assert calls[:12] == ["a"] * 5 + ["b"] + ["a"] * 5 + ["b"]
    assert b >= 2000 > 20 * a          # microseconds: the sleep is in b's median, not in a's
