"""Many sources in one engine (app/runtime/engine.py) and `classify FILE FILE ...`: each stream's
records equal the engine's for that source alone (capacity 1: on the CPU the front end's
one-stream path), whenever it joined, whatever else ran and whichever shard held it (on CUDA too,
skipped without it: the batched front end and models against the CPU's engine alone); a stream
that fails leaves alone."""
import json

import numpy as np
import pytest
import torch

from app.runtime.engine import Engine
from app.runtime.lineup import Entry
from audio.frontends import build_frontend
from audio.sources import DemoSource, FileSource
from audio_helpers import tone, write
from tiny import tiny_model

# As tests/app/test_engine.py PROB_TOL: probabilities are rounded to 6 decimals (the two records
# differ by at most 1e-6 from rounding); each path's logits are within K EPS32 (1 + S) sqrt(n) of
# float64 (tests/error_model.py; S, the largest score of these tiny models on these streams, was
# measured at 0.46; n = 8; K = 6 stages, 10 for Nystrom blocks: 3.0e-6 and 4.9e-6), and a
# probability moves by at most half its logits' largest change: 1e-6 + (3.0 + 4.9) e-6 / 2 = 5e-6.
# The two paths' tokens differ too (the batched and the single-stream front end round
# differently: at most 7.3e-7 observed for musicnn, 3 streams over 60 hops in each accumulator
# mode); through these tiny models' embedding (gain below 1) that is at most 1e-6 more: 6e-6.
PROB_TOL = 6e-6
MODELS = [("regular", None, 1, 1), ("continual", None, 2, 4), ("nystrom", None, 1, 4),
          ("continual_nystrom", "continual", 1, 4), ("continual_nystrom", "continual", 2, 1)]


@pytest.fixture(scope="module")
def frontend():
    return build_frontend("musicnn")


def entries(frontend: str = "musicnn", models=MODELS, device: str = "cpu"):
    out = []
    for i, (variant, mode, layers, spacing) in enumerate(models):
        model = tiny_model(variant, n=8, in_dim={"musicnn": 50, "vggish": 128}[frontend], layers=layers,
                           seed=i).use_fused(device == "cpu").to(device)
        out.append(Entry(f"{variant}/{layers}/{spacing}", model, True, spacing, frontend))
    return out


def alone(frontend, source) -> list:
    es = entries(frontend.name, MODELS if frontend.name == "musicnn" else MODELS[1:2])
    engine = Engine(frontend, es, capacity=1)
    return list(engine.run([source]))


def same(errors, got: list, want: list) -> None:
    assert [r.step for r in got] == [r.step for r in want]
    assert [r.audio_time for r in got] == [r.audio_time for r in want]
    worst = 0.0
    for g, w in zip(got, want):
        assert g.source == w.source and set(g.models) == set(w.models)
        for name, m in g.models.items():
            worst = max(worst, float(np.abs(np.subtract(m.probabilities, w.models[name].probabilities)).max()))
            assert m.warm == w.models[name].warm and m.spacing == w.models[name].spacing
            assert m.flops["model"] >= w.models[name].flops["model"]           # + the branch-free rescale
    errors("many streams vs each source alone (probabilities)", worst, PROB_TOL)


def named(source, name: str):
    source.name = name
    return source


@pytest.mark.parametrize("device,shards", [("cpu", 1), ("cpu", 2), pytest.param("cuda", 1, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_streams_joining_at_different_hops_each_equal_their_source_alone(frontend, device, shards, tmp_path, errors):
    """With 2 shards (capacity 2 + 1): the first two streams in one each, the third with the first."""
    song = write(tmp_path / "song.wav", tone(3.0, 22050, 330.0, channels=2), 22050)
    make = {"demo:0": lambda: named(DemoSource(seed=0, seconds=5), "demo:0"), "file:song.wav": lambda: FileSource(song),
            "demo:3": lambda: named(DemoSource(seed=3, seconds=2), "demo:3")}
    streams_frontend = frontend if device == "cpu" else build_frontend("musicnn", device=device)
    engine = Engine(streams_frontend, entries(device=device), capacity=3, shards=shards)
    got = {name: [] for name in make}
    order = []
    held = [engine.join(make["demo:0"]()).shard, engine.join(make["file:song.wav"]()).shard]
    hop = 0
    while engine.streams:
        if hop == 5:
            held.append(engine.join(make["demo:3"]()).shard)          # joins at hop 5
        records = engine.hop()
        order.append([r.source for r in records])
        for r in records:
            got[r.source].append(r)
        hop += 1
    for name, records in got.items():
        same(errors, records, alone(frontend, make[name]()))
    assert [len(got[n]) for n in make] == [20, 12, 8] and engine.errors == []
    assert held == ([0, 1, 0] if shards == 2 else [0, 0, 0])
    assert all(o == [n for n in make if n in o] for o in order)        # each hop's records in joining order


def test_a_server_on_the_cpu_takes_a_shard_per_thread_from_8_streams_on_and_on_cuda_one():
    from app.runtime.engine import default_shards
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu = torch.device("cpu")
        assert [default_shards(cpu, c) for c in (1, 4, 7, 8, 32)] == [1, 1, 1, 2, 2]
        torch.set_num_threads(16)
        assert [default_shards(cpu, c) for c in (8, 32, 256)] == [2, 8, 16]
        assert default_shards(torch.device("cuda"), 256) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_full_engine_refuses_a_stream_and_a_leaver_frees_its_shard(frontend):
    """Streams join the shard with the fewest streams; with every slot taken, one line."""
    engine = Engine(frontend, entries("musicnn", MODELS[1:2]), capacity=3, shards=2)
    assert [s.capacity for s in engine.shards] == [2, 1]
    streams = [engine.join(DemoSource(seed=i, seconds=1)) for i in range(3)]
    assert [s.shard for s in streams] == [0, 1, 0] and [s.number for s in engine.streams] == [0, 1, 2]
    with pytest.raises(ValueError, match="all 3 streams are taken"):
        engine.join(DemoSource(seed=3, seconds=1))
    engine.leave(streams[1])
    assert engine.join(DemoSource(seed=4, seconds=1)).shard == 1


def test_vggish_streams_batched_equal_each_source_alone(errors):
    vggish = build_frontend("vggish", random_vggish=0)
    engine = Engine(vggish, entries("vggish", MODELS[1:2]), capacity=2)
    got = {"demo:0": [], "demo:1": []}
    engine.join(named(DemoSource(seed=0, seconds=2.5), "demo:0"))
    for hop in range(12):
        if hop == 2:
            engine.join(named(DemoSource(seed=1, seconds=1.5), "demo:1"))
        for r in engine.hop():
            got[r.source].append(r)
    for name, seconds in (("demo:0", 2.5), ("demo:1", 1.5)):
        same(errors, got[name], alone(vggish, named(DemoSource(seed=int(name[-1]), seconds=seconds), name)))


@pytest.mark.parametrize("shards", [1, 2])
def test_a_stream_whose_file_changes_leaves_and_the_others_run_to_their_end(frontend, shards, tmp_path, errors):
    victim = write(tmp_path / "v.wav", tone(6.0, 16000, 440.0), 16000)
    engine = Engine(frontend, entries(), capacity=2, shards=shards)
    records = {"file:v.wav": [], "demo": []}
    engine.join(FileSource(victim))
    engine.join(DemoSource(seed=0, seconds=4))
    for r in engine.run([]):
        records[r.source].append(r)
        if len(records["file:v.wav"]) == 2:
            write(victim, tone(6.0, 16000, 220.0), 16000)          # rewritten while it is read
    (stream, why), = engine.errors
    assert stream.name == "file:v.wav" and "changed while it was being read" in why
    assert len(records["file:v.wav"]) < 24 and len(records["demo"]) == 16
    same(errors, records["demo"], alone(frontend, DemoSource(seed=0, seconds=4)))


def test_a_warmed_engine_gives_the_records_of_a_cold_one(frontend):
    """``warm()`` (what `serve` runs before its first client: the models' scratch streams, two
    hops of silence in a front-end slot) leaves nothing behind: the same records, bit for bit."""
    runs = []
    for warm in (False, True):
        engine = Engine(frontend, entries(), capacity=2)
        if warm:
            engine.warm()
        for seed, seconds in ((0, 3), (1, 2)):
            engine.join(named(DemoSource(seed=seed, seconds=seconds), f"demo:{seed}"))
        runs.append([(r.source, r.step, {n: m.probabilities for n, m in r.models.items()}, r.mel.tobytes())
                     for r in engine.run([])])
    assert runs[0] == runs[1] and len(runs[0]) == 12 + 8


def classify(capsys, *args):
    """main.py classify ARGS in this process: (exit status, stdout, stderr)."""
    from app.cli import main
    code = main(["classify", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_classify_runs_several_files_as_streams_and_says_which_one_failed(tmp_path, capsys):
    a = write(tmp_path / "a.wav", tone(2.0, 44100, 440.0, channels=2), 44100)
    b = write(tmp_path / "b.flac", tone(3.0, 16000, 220.0), 16000)
    code, out, err = classify(capsys, a, tmp_path / "missing.wav", b, a, "--jsonl")
    assert code == 1
    assert [x for x in err.splitlines() if x.startswith("error:")] == [
        f"error: audio file not found: {tmp_path / 'missing.wav'}"]
    lines = [json.loads(x) for x in out.splitlines()]
    records = [x for x in lines if "verdict" not in x]
    verdicts = [x for x in lines if "verdict" in x]          # one per stream, as it ends
    assert sorted(v["source"] for v in verdicts) == ["file:a.wav", "file:a.wav#2", "file:b.flac"]
    assert all(v["hops"] == sum(r["source"] == v["source"] for r in records) and v["error"] is None for v in verdicts)
    by_source = {}
    for x in records:
        by_source.setdefault(x["source"], []).append(x["step"])
    assert by_source == {"file:a.wav": list(range(8)), "file:b.flac": list(range(12)), "file:a.wav#2": list(range(8))}
    assert err.count("# verdict over") == 3                    # the numbers: the tests above
    assert [x["audio_time"] for x in records if x["source"] == "file:a.wav"] == [0.25 * (i + 1) for i in range(8)]


def test_classify_demo_n_runs_n_streams(tmp_path, capsys):
    out = tmp_path / "steps.csv"
    code, _, err = classify(capsys, "--demo", "3", "--seconds", "1", "--csv", out)
    assert code == 0, err
    import csv
    rows = list(csv.DictReader(out.open()))
    assert sorted({x["source"] for x in rows}) == ["demo:0", "demo:1", "demo:2"] and len(rows) == 12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_classify_one_file_on_cuda_steps_its_models_as_a_batch_of_one(tmp_path, capsys):
    """`classify FILE --device cuda`: the batched engine with one stream (each model step a replayed
    CUDA graph), the same records as on the CPU: steps, times, source, and each model's top
    genre wherever the CPU's top two are more than 1e-3 apart (the two paths differ by float32
    rounding, a few 1e-6 in these tests, so a top can only swap in a near tie)."""
    song = write(tmp_path / "song.wav", tone(6.0, 22050, 330.0, channels=2), 22050)
    runs = []
    for flag in ([], ["--device", "cuda"]):
        code, out, err = classify(capsys, song, "--jsonl", *flag)
        assert code == 0, err
        runs.append([json.loads(x) for x in out.splitlines() if '"verdict"' not in x])
    cpu, cuda = runs
    assert [(r["step"], r["audio_time"], r["source"]) for r in cuda] == [(r["step"], r["audio_time"], r["source"]) for r in cpu]
    assert len(cuda) == 24
    for a, b in zip(cpu, cuda):
        for name, m in a["models"].items():
            p = sorted(m["probabilities"])
            if p[-1] - p[-2] > 1e-3:
                assert b["models"][name]["top"][0] == m["top"][0]
