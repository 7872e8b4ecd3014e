"""`bench` measures what it names: rows filtered by --only, fused and torch paths of one variant
with the same FLOPs per step (one set of formulas, the same steps), ratios taken in one run."""
import json

from app.offline import bench


def test_bench_only_rows_fused_and_torch_paths_count_the_same_flops(tmp_path):
    out = tmp_path / "bench.md"
    rows = bench.run(windows=(12,), steps=25, budget_s=0.2, out=out, only="continual_nystrom/fixed")
    names = [r.what for r in rows]
    assert names and all("continual_nystrom/fixed" in w for w in names), names
    assert {"SDA continual_nystrom/fixed (torch)", "SDA continual_nystrom/fixed (fused)",
            "model 2-block continual_nystrom/fixed (fused)"} <= set(names)
    by = {r.what: r for r in rows}
    for w in names:
        if w.endswith(" (fused)"):   # means over the timed steps: a stability refresh among them
            ref = by[w.replace("(fused)", "(torch)")].flops     # adds ~100 FLOPs, and a slow host
            assert abs(by[w].flops - ref) <= 1e-3 * ref, w      # times fewer steps in the budget
        assert by[w].median_us > 0 and by[w].flops > 0
    text = out.read_text()
    assert "fused vs torch path" in text and "Audio front end" not in text
    assert len(json.loads(out.with_suffix(".json").read_text())) == len(rows)
