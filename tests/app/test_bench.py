"""`bench` measures what it names: rows filtered by --only, fused and torch paths of one variant
with the same FLOPs per step (one set of formulas, the same steps), ratios taken in one run."""
import json
import math
import subprocess

import pytest

from app.bench import steps as bench


def test_bench_only_rows_fused_and_torch_paths_count_the_same_flops(tmp_path):
    out = tmp_path / "bench.md"
    # 10 steps: the least a row times whatever its budget, so every row's FLOP mean is over the
    # same steps on any host (the budget only bounds the paired speed-up timing)
    data = bench.run(windows=(12,), steps=10, budget_s=0.2, out=out, only="continual_nystrom/fixed")
    rows = [bench.Row(**r) for r in data["rows"]]
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
    assert json.loads(out.with_suffix(".json").read_text()) == data


def test_the_benchmark_page_is_written_from_the_stored_runs(tmp_path):
    """`bench ... --page`: each run kind stored as JSON with its command, date, machine and the
    checkout's commit (git's own answer); the page is rendered from every stored run, a new run
    of a kind replacing its section."""
    from app.bench import page as bench_page
    data = bench.run(windows=(12,), steps=10, budget_s=0.2, out=tmp_path / "b.md", only="SDA continual (")
    store, page = tmp_path / "runs", tmp_path / "benchmarks.md"
    bench_page.record("attention", data, ["bench", "--windows", "12", "--page"], store=store, page=page)
    control = {"seconds": 5, "hops": 20, "calls": 500, "dropped_hops": 0, "fits": 6, "events": 40,
               "errors": [], "control_ms_median": 0.5, "control_ms_p95": 3.0, "control_ms_max": 21.0,
               "frontend": "musicnn"}
    bench_page.record("control", control, ["bench", "--control", "5", "--page"], store=store, page=page)
    text = page.read_text()
    entry = json.loads((store / "attention.json").read_text())
    assert entry["data"] == json.loads(json.dumps(data)) and entry["machine"]["cores"] >= 1
    assert 0 < entry["machine"]["speed_index_ms"] < 100
    assert text.index("## Attention and model steps") < text.index("## Live control under load")
    assert "*`python main.py bench --windows 12 --page`, " in text and "speed index" in text
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bench_page.ROOT, capture_output=True, text=True).stdout
    assert entry["commit"].split()[0] == head[:7] and f", code at commit {entry['commit']}, " in text
    for r in data["rows"]:
        assert f"| {r['what']} | {r['median_us']:,.1f} |" in text
    assert "| 500 | 20 | 0 | 6 | 0 | 0.50 / 3.00 / 21.00 |" in text
    control["dropped_hops"] = 3
    bench_page.record("control", control, ["bench", "--control", "5", "--page"], store=store, page=page)
    assert "| 500 | 20 | 3 | 6 |" in page.read_text() and page.read_text().count("## Live control") == 1


def test_every_stored_streams_run_reaches_the_page_cpu_first(tmp_path):
    """Runs of `bench --streams` are stored by device, models and precision
    (streams-DEVICE[-MODEL...][-PRECISION]); the page shows every one of them, the CPU's first, and
    a TF32 run its error against float32 and the front end's default way as the code has it."""
    from app.bench import page as bench_page
    from app.bench.streams import streams_key
    stored = bench_page.ROOT / "docs" / "benchmarks"
    store = tmp_path / "runs"
    store.mkdir()
    keys = ["streams-cpu", streams_key("cuda", ["continual_nystrom"], "tf32"), streams_key("cuda", None, "tf32")]
    assert keys[1:] == ["streams-cuda-continual_nystrom-tf32", "streams-cuda-tf32"]
    assert streams_key("cpu", None, "float32") == "streams-cpu" and streams_key("cpu", None, "bf16") == "streams-cpu-bf16"
    for key, name in zip(keys, ["streams-cpu", keys[1], keys[1]]):
        entry = json.loads((stored / f"{name}.json").read_text())
        entry["kind"] = key
        (store / f"{key}.json").write_text(json.dumps(entry))
    text = bench_page.render(store)
    at = [text.index(f"*`{json.loads((store / f'{k}.json').read_text())['command']}`") for k in keys]
    assert at[0] < min(at[1:]) and text.count("## Many streams in one engine") == 1
    assert text.count("TF32 against float32 (64 streams through both, the demo signal, seeds 0-63, 30 s each;") == 2
    assert "| 4096 | K = 128 only (default) |" in text and "| 8 | none (default) |" in text


def test_the_onnx_rows_time_the_three_steps_of_one_model_and_reach_the_page(tmp_path):
    from app.bench import page as bench_page
    from app.bench.onnx import onnx_bench
    r = onnx_bench(steps=20, budget_s=0.2, only="musicnn-continual (")
    (row,) = r["rows"]
    assert row["model"] == "musicnn-continual (trained, n = 29)" and row["bytes"] > 1e6
    assert row["blocks"] == 1 and 20 < row["nodes"] < 200      # the graph's top level
    for path in ("torch", "fused", "onnx"):
        assert row[path]["median_us"] > 0 and row[path]["p95_us"] >= row[path]["median_us"]
    assert row["onnx"]["flops"] == row["torch"]["flops"] == row["fused"]["flops"]   # the same step
    page = tmp_path / "benchmarks.md"
    bench_page.record("onnx", r, ["bench", "--onnx", "--page"], store=tmp_path / "runs", page=page)
    ratio = row["torch"]["median_us"] / row["onnx"]["median_us"]
    assert f"| musicnn-continual (trained, n = 29) | {row['torch']['flops']['model'] / 1e3:.0f}k |" in page.read_text()
    assert f"{ratio:.2f}x / " in page.read_text()
    assert f"with one block, it took {row['onnx']['median_us'] / row['fused']['median_us']:.1f} to " in page.read_text()


def test_paired_medians_time_each_function_in_alternating_blocks():
    import time
    from app.bench.timing import paired_medians
    calls = []

    def fast():
        calls.append("a")

    def slow():
        calls.append("b")
        time.sleep(0.002)

    a, b = paired_medians(fast, slow, budget_s=0.05, block_a=5, block_b=1)
    assert calls[:12] == ["a"] * 5 + ["b"] + ["a"] * 5 + ["b"]
    assert b >= 2000 > 20 * a          # microseconds: the sleep is in b's median, not in a's


@pytest.mark.parametrize("start", [1, 256])
@pytest.mark.parametrize("capacity", [0, 1, 7, 8, 11, 12, 15, 100, 1000, 4095])
def test_streams_search_doubles_then_halves_to_the_capacity(capacity, start):
    """`bench --streams` times S = 1, 2, 4, ... (or from ``start``, halving down while that is
    over) until a p95 passes 125 ms, then halves the gap: against a host whose p95 passes 125 ms
    beyond ``capacity`` streams, the search's capacity is within 1/8 below the true one (exact
    below 16 streams), timing no S twice, and it stops at ``max_streams``."""
    from app.bench.streams import REAL_TIME_MS, next_streams
    rows = []
    while (s := next_streams(rows, max_streams=1 << 16, start=start)) is not None:
        assert s not in [r["streams"] for r in rows]
        rows.append({"streams": s, "hop_ms_p95": REAL_TIME_MS * (1 if s <= capacity else 1.01)})
        assert len(rows) <= 40
    found = max([r["streams"] for r in rows if r["hop_ms_p95"] <= REAL_TIME_MS], default=0)
    assert found <= capacity and capacity - found <= max(0, capacity // 8)
    if capacity < 16:
        assert found == capacity
    assert next_streams([{"streams": s, "hop_ms_p95": 1.0} for s in (1, 2, 4)], max_streams=4) is None


def test_memory_per_stream_is_the_median_slope_over_the_top_rows():
    """Rows in fresh processes: resident MB = a + b·S over S from half the largest count up; the
    median of the slopes between every two rows recovers b exactly, ignores the small-S rows
    below that, and stays b when one of five rows is off by 100 MB (a heap grown unlike the
    others), where a least-squares slope would not."""
    from app.bench.streams import per_stream_mb
    rows = [{"streams": s, "rss_mb": (50.0 if s < 8 else 10.0 + 4.5 * s)} for s in (1, 2, 4, 8, 16, 12, 10, 11)]
    assert per_stream_mb(rows) == pytest.approx(4.5, rel=1e-12)
    for odd in (8, 11, 16):
        off = [dict(r, rss_mb=r["rss_mb"] + (100.0 if r["streams"] == odd else 0.0)) for r in rows]
        assert per_stream_mb(off) == pytest.approx(4.5, rel=1e-12)
    assert math.isnan(per_stream_mb(rows[:1]))


def test_streams_bench_rows_memory_and_capacity_follow_from_its_hops(capsys):
    """`bench --streams`, two rows (1 and 2 demo streams): each row's FLOPs are the front end's and
    the five models' per stream-hop, its GFLOP/s those over its median hop; memory per added
    stream is the last doubling's, of the memory held once the free heap is given back (at most
    what was resident before); the capacity the largest row within half a hop; the last line
    says it."""
    from app.bench.streams import REAL_TIME_MS, print_streams, streams_bench, streams_table
    r = streams_bench("cpu", hops=3, warm=2, max_streams=2)
    rows = r["rows"]
    assert [x["streams"] for x in rows][:1] == [1] and len(r["models"]) == 5
    for x in rows:
        assert 0 < x["frontend_flops_per_stream_hop"] < x["flops_per_stream_hop"]
        assert x["hop_ms_p95"] >= x["hop_ms_median"] > 0
        assert abs(x["gflops"] - x["flops_per_stream_hop"] * x["streams"] / (x["hop_ms_median"] * 1e6)) < 1e-9
        assert 0 < x["rss_mb"] <= x["rss_with_free_heap_mb"] + 1.0        # 1 MB: a page table's worth
    assert "resident (MB) | with free heap (MB) |" in streams_table(r)[0]
    assert r["capacity"] == max([x["streams"] for x in rows if x["hop_ms_p95"] <= REAL_TIME_MS], default=0)
    if len(rows) == 2:
        assert r["mb_per_stream"] == pytest.approx(rows[1]["rss_mb"] - rows[0]["rss_mb"], rel=1e-9, abs=1e-9)
    print_streams(r)
    assert capsys.readouterr().out.splitlines()[-1] == f"real-time capacity: {r['capacity']} streams (cpu)"


def test_frontend_modes_table_compares_the_three_ways_on_the_same_pushes():
    """`bench --streams`, its front-end table (2 streams, 2 timed pushes): a row per way of keeping
    the temporal branches, the CPU's default marked; accumulators trade state (K - 1 edge rows of
    51 x 96 floats for a branch of K taps) for multiply-accumulates, so every branch's has the
    fewest MFLOPs and the most state, none the reverse."""
    from app.bench.frontend_modes import MODES, frontend_modes_bench, modes_table
    rows = frontend_modes_bench("cpu", sizes=(2,), hops=2, warm=1)
    by = {r["mode"]: r for r in rows}
    assert list(by) == list(MODES) and all(r["streams"] == 2 and r["push_ms_median"] > 0 for r in rows)
    flops = [by[m]["mflops_per_stream_hop"] for m in MODES]
    state = [by[m]["state_mb_per_stream"] for m in MODES]
    assert flops == sorted(flops) and len(set(flops)) == 3
    assert state == sorted(state, reverse=True)
    row = 51 * 96 * 4 / 1e6
    assert state[0] - state[1] == pytest.approx((63 + 31) * row) and state[1] - state[2] == pytest.approx(127 * row)
    assert [r["default"] for r in rows] == [False, False, True]                   # the CPU: none
    table = modes_table(rows, "cpu")
    assert len(table) == 2 + len(rows) and [("(default)" in line) for line in table[2:]] == [False, False, True]
    on_cuda = [("(default)" in line) for line in modes_table(rows, "cuda", "float32")[2:]]
    assert on_cuda == [True, False, False]                  # CUDA in float32: every branch's accumulators
    assert [("(default)" in line) for line in modes_table(rows, "cuda", "tf32")[2:]] == [False, True, False]


def test_a_capped_run_says_its_capacity_is_at_least_its_last_row():
    """`bench --streams --streams-to S` stops at S: within real time there, the capacity is only
    known to be at least S, and the text says so; a row past real time below the cap is the
    capacity as usual."""
    from app.bench.streams import REAL_TIME_MS, capacity_text
    rows = [{"streams": s, "hop_ms_p95": REAL_TIME_MS / 2} for s in (1, 2, 4)]
    assert capacity_text({"rows": rows, "capacity": 4, "capped_at": 4}) == "at least 4 streams (the run stopped at 4)"
    assert capacity_text({"rows": rows, "capacity": 4}) == "4 streams"
    over = rows[:2] + [{"streams": 4, "hop_ms_p95": 2 * REAL_TIME_MS}]
    assert capacity_text({"rows": over, "capacity": 2, "capped_at": 4}) == "2 streams"


def test_the_engines_bench_runs_each_installed_engine_within_float32_rounding(tmp_path):
    """`bench --engines` at one stream: the head by torch against the float64 head, the whole
    continual push by torch, ONNX Runtime and (where installed) OpenVINO; the page draws it.
    Error model (tests/audio/test_musicnn_batch.py): float32 stages, each a dot product of at most
    TERMS terms (7 frames x 561 channels), relative to the logits' scale max(1, |logit|). The head:
    its 6 stages against the float64 head. The push graph: eager, it is MusicnnBatch's push bit
    for bit; another engine and that push are each within the 8-stage taggram bound of the float64
    network, and a sigmoid moves by at most a quarter of its logit's change, so by at most
    sigma'(x) max(1, |x|) <= 1/4 of the relative bound: they differ by at most twice that."""
    import importlib.util

    from app.bench import page as bench_page
    from app.bench.engines import PARTS, measure
    from error_model import EPS32
    TERMS = 7 * 561
    rows, missing = [], set()
    for part, engines in ((PARTS[1], ("torch",)), (PARTS[3], ("torch", "onnxruntime", "openvino"))):
        got, gone = measure(part, 1, engines, calls=2, threads=2)   # here (the bench: a fresh process each)
        rows += got
        missing.update(gone)
    r = {"rows": rows, "threads": 2, "calls": 2, "missing": sorted(missing), "versions": {}}
    installed = importlib.util.find_spec("openvino") is not None
    assert r["missing"] == ([] if installed else ["openvino"])
    engines = {"torch", "onnxruntime"} | ({"openvino"} if installed else set())
    head = {x["engine"]: x for x in r["rows"] if x["part"].startswith("head")}
    push = {x["engine"]: x for x in r["rows"] if x["part"].startswith("the continual push")}
    assert set(head) == {"torch"} and set(push) == engines
    for engine, row in head.items():
        assert row["streams"] == 1 and row["median_ms"] > 0
        tol = 6 * EPS32 * math.sqrt(TERMS) * max(1.0, row["reference_max_abs"])
        assert row["max_abs_diff"] <= tol, (engine, row["max_abs_diff"], tol)
    assert push["torch"]["max_abs_diff"] == 0
    for engine, row in push.items():
        assert row["max_abs_diff"] <= 2 * 8 * EPS32 * math.sqrt(TERMS) / 4, (engine, row["max_abs_diff"])
    page = tmp_path / "benchmarks.md"
    bench_page.record("engines", r, ["bench", "--engines", "--page"], store=tmp_path / "runs", page=page)
    text = page.read_text()
    assert "## The front end by inference engine" in text and "| streams | torch | onnxruntime" in text
    assert f"({push['torch']['median_ms'] / push['onnxruntime']['median_ms']:.2f}x)" in text


def test_the_precision_study_sets_the_same_streams_side_by_side():
    """float32 against itself differs nowhere (the study pairs each stream's hops and steps with
    their own); bf16 (where this CPU has it) differs, on the same steps and verdicts."""
    from app.bench.precision import precision_error
    from app.bench.streams import demo_stream
    from audio.musicnn import bf16_hardware
    sources = [lambda i=i: demo_stream(i, 3.0) for i in range(2)]
    same = precision_error("cpu", "float32", models=["continual"], sources=sources)
    assert (same["taggram_max_abs"], same["probability_max_abs"], same["top_differs"], same["verdicts_changed"]) == (0, 0, 0, 0)
    assert same["streams"] == 2 and same["verdicts"] == 2 and same["steps"] > 0
    if bf16_hardware():
        low = precision_error("cpu", "bf16", models=["continual"], sources=sources)
        assert low["taggram_max_abs"] > 0 and (low["steps"], low["verdicts"]) == (same["steps"], same["verdicts"])


def test_a_window_run_with_no_hop_is_one_line_and_a_page_row_of_none(tmp_path, capsys):
    """`bench --gui` whose engine gave no hop (a starved first Start): one line with the time
    waited, never a traceback; stored, its page column says 'none' for the first hop and '-'
    for what needs hops, beside a run that had them."""
    from app.bench import page as bench_page
    from app.commands.bench import print_gui
    empty = {"seconds": 60.2, "hops": 0, "hogs": 2, "cores": 2, "prepared_s": 2.5, "push": None, "kernels": None,
             "first_hop_s": None, "models": 0, "cold": True}
    print_gui(empty)
    out = capsys.readouterr().out.splitlines()
    assert out == ["GUI: no hop within 60 s of Start (2 cores, 2 CPU hogs beside it; empty caches; "
                   "engine process ready 2.50 s after the window opened)"]
    store, page = tmp_path / "runs", tmp_path / "benchmarks.md"
    bench_page.record("gui-hogs2-cold", empty, ["bench", "--gui", "60", "--hogs", "2", "--cold"], store=store, page=page)
    lines = page.read_text().splitlines()
    assert "| first hop after Start (s) | none | <= 3 empty caches, <= 1.5 warm |" in lines
    assert "| hops shown / dropped | 0 / - | 0 dropped |" in lines
    assert "| end-to-end delay median / p95 (ms) | - | p95 <= 100 quiet, 200 with two hogs |" in lines
