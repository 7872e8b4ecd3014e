"""One stream's continual musicnn push as one graph (audio/musicnn/graph.py): GraphStream, eager,
is MusicnnBatch's push of one slot bit for bit at every hop, whatever number of frames it brings,
with the same multiply-accumulates, and within float32 rounding of the float64 network; compiled
ahead of time (AOTInductor: the libraries `nystream prepare` builds into the user's cache, which
`make test` runs first, else built here once at this process's priority), its taggrams stay
within float32 rounding of the float64 network, a front end loads them without building, and a
build over a cache that has them removes what they replace without compiling again; a
build that cannot compile leaves every hop eager with a one-line reason, not tried again (also
when its log is gone); a damaged library is removed, every hop eager, with a one-line reason; a
build that finds another live builder's lock waits for it, and a dead builder's lock is taken over; only
a single stream starts a build."""
import copy
import os
import time

import numpy as np
import pytest
import torch

from audio import musicnn
from audio.musicnn.batch import MusicnnBatch
from audio.musicnn.graph import (BUSY, STEADY_FRAMES, CompiledPushes, GraphStream, build_packages, cache_dir,
                                 package_key, prepare, take_lock)
from test_musicnn_batch import frames, logits64_of, taggram_tol

# 0.25 s hops bring 15 or 16 frames; also none, one, more than the K = 32 and 64 branches'
# end-edge rows (40), a jump past the temporal kernels, a whole patch
HOPS = [15, 16, 40, 0, 1, 80, 16, 200, 15, 16, 15, 16, 59, 60]


@pytest.fixture(scope="module")
def nets():
    net, checksum = musicnn.build_musicnn()
    net.requires_grad_(False)
    return net, copy.deepcopy(net).double(), checksum


def test_the_eager_graph_is_the_batch_of_one_bit_for_bit(nets, errors):
    """Two streams taking turns, the second sharing the first's tables (``like``), each against
    a batch of its own; the second's hops are the first's shifted, so that one's jump falls
    between the other's hops."""
    net, net64, _ = nets
    rng = np.random.default_rng(3)
    first = GraphStream(net)
    streams = [first, GraphStream(net, like=first)]
    batches = [MusicnnBatch(net, 1), MusicnnBatch(net, 1)]
    for b in batches:
        b.reset(0)
    histories, worst, tol = [[], []], 0.0, float("inf")
    for hop in range(len(HOPS)):
        for i, (stream, batch) in enumerate(zip(streams, batches)):
            k = HOPS[(hop + 3 * i) % len(HOPS)]
            x = frames(rng, k)
            got, want = stream.push(x), batch.push([0], [x])[0]
            assert torch.equal(got, want), (i, k)
            assert stream.last_macs == batch.macs[0], (i, k)
            histories[i].append(x)
            logits = logits64_of(net64, histories[i])
            worst = max(worst, (got.double() - torch.sigmoid(logits)).abs().max().item())
            tol = min(tol, taggram_tol(logits))
    assert streams[1].batch is first.batch and streams[1].graphs is first.graphs
    errors("one stream's push as a graph vs the float64 network", worst, tol)


def test_the_compiled_push_is_loaded_from_the_prepared_cache_and_within_float32_rounding(nets, tmp_path, monkeypatch,
                                                                                        errors):
    """The prepared libraries (both hop sizes) load at once; a build over a copy of them
    compiles nothing and removes an older code's library of the same k and its failure note,
    keeping other k's and precisions'."""
    import shutil
    net, net64, checksum = nets
    threads = torch.get_num_threads()
    assert not prepare(threads).startswith("not built"), "this machine cannot compile the push (no C++ compiler)"
    built = [cache_dir() / f"{package_key('MSD_musicnn', checksum, k, threads)}.pt2" for k in STEADY_FRAMES]
    old = [tmp_path / f"push-MSD_musicnn-float32-k16-t{threads}-{'0' * 16}.pt2",  # an older code's, replaced
           tmp_path / f"push-MSD_musicnn-float32-k0-t{threads}-{'0' * 16}.failed"]
    others = [tmp_path / f"push-MSD_musicnn-float32-k14-t{threads}-{'0' * 16}.pt2",   # another k's: kept
              tmp_path / f"push-MSD_musicnn-bf16-k16-t{threads}-{'0' * 16}.pt2"]     # another precision's: kept
    for p in old + others:
        p.write_text("x")
    for p in built:
        shutil.copy(p, tmp_path / p.name)
    stamps = {p.name: (tmp_path / p.name).stat().st_mtime_ns for p in built}
    assert build_packages("MSD_musicnn", "float32", list(STEADY_FRAMES), threads, tmp_path) == 0
    assert not any(p.exists() for p in old) and all(p.exists() for p in others)
    assert {p.name: (tmp_path / p.name).stat().st_mtime_ns for p in built} == stamps     # not built again
    for p in others:
        p.unlink()
    monkeypatch.setenv("NYSTREAM_PUSH_CACHE", str(tmp_path))
    monkeypatch.setenv("NYSTREAM_COMPILED_PUSH", "1")
    again = CompiledPushes("MSD_musicnn", checksum, STEADY_FRAMES)       # a front end: loads them at once
    assert again.status == "compiled" and again.build is None and again.get(15) is not None
    rng = np.random.default_rng(4)
    compiled, eager = GraphStream(net, again), GraphStream(net)
    history, worst, tol, apart = [], 0.0, float("inf"), 0.0
    for k in HOPS:
        x = frames(rng, k)
        got, want = compiled.push(x), eager.push(x)
        assert compiled.last_macs == eager.last_macs
        history.append(x)
        logits = logits64_of(net64, history)
        worst = max(worst, (got.double() - torch.sigmoid(logits)).abs().max().item())
        tol = min(tol, taggram_tol(logits))
        apart = max(apart, (got - want).abs().max().item())
    assert apart <= 2 * tol                  # each within the bound of the float64 network
    errors("one stream's compiled push vs the float64 network", worst, tol)


def test_a_build_that_cannot_compile_leaves_the_push_eager_with_its_reason(nets, tmp_path, monkeypatch):
    net, _, checksum = nets
    monkeypatch.setenv("NYSTREAM_PUSH_CACHE", str(tmp_path))
    monkeypatch.setenv("NYSTREAM_COMPILED_PUSH", "1")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))          # inductor's C++ compiler
    pushes = CompiledPushes("MSD_musicnn", checksum, (16,))
    pushes.wait(600)
    assert pushes.status == "eager: the compiled push could not be built (no working C++ compiler: inductor needs g++ (or $CXX))"
    assert not list(tmp_path.glob("*.pt2"))
    assert pushes.failed.exists()
    stream, batch = GraphStream(net, pushes), MusicnnBatch(net, 1)       # every hop eager: the batch's floats
    batch.reset(0)
    x = frames(np.random.default_rng(5), 16)
    assert torch.equal(stream.push(x), batch.push([0], [x])[0])
    t0 = os.stat(pushes.failed).st_mtime_ns
    later = CompiledPushes("MSD_musicnn", checksum, (16,))                 # not tried again
    assert later.build is None and later.status == pushes.status and os.stat(later.failed).st_mtime_ns == t0


def test_a_build_that_ends_without_its_log_still_says_why_in_one_line(nets, tmp_path, monkeypatch):
    """The cache emptied while a build ran (its log gone with it): the status says how the
    builder ended, and the next hop runs on, eager."""
    import subprocess
    import sys
    net, _, checksum = nets
    monkeypatch.setenv("NYSTREAM_PUSH_CACHE", str(tmp_path))
    pushes = CompiledPushes("MSD_musicnn", checksum, (16,))
    pushes.close()                                                          # the real build, stopped
    pushes.build = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])   # a builder that fails
    pushes.failed.with_suffix(".log").unlink()
    pushes.build.wait()
    stream = GraphStream(net, pushes)
    stream.push(frames(np.random.default_rng(7), 16))                      # looks at the build: no error
    assert pushes.status == "eager: the compiled push could not be built (exit status 1)"


def test_a_damaged_library_is_removed_and_every_hop_stays_eager(nets, tmp_path, monkeypatch):
    """A library cut short or overwritten in the cache: not loaded, removed (built again at the
    next start), the reason in one line; no build now."""
    net, _, checksum = nets
    monkeypatch.setenv("NYSTREAM_PUSH_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    for k, junk in ((15, b""), (16, b"PK\x03\x04 not a whole package")):
        (tmp_path / f"{package_key('MSD_musicnn', checksum, k, threads)}.pt2").write_bytes(junk)
    pushes = CompiledPushes("MSD_musicnn", checksum, (15, 16))
    assert pushes.status.startswith("eager: the compiled push could not be loaded (") and "\n" not in pushes.status
    assert pushes.build is None and pushes.get(16) is None and not list(tmp_path.glob("*.pt2"))
    stream, batch = GraphStream(net, pushes), MusicnnBatch(net, 1)
    batch.reset(0)
    x = frames(np.random.default_rng(6), 16)
    assert torch.equal(stream.push(x), batch.push([0], [x])[0])


def test_a_dead_builders_lock_is_taken_over_and_a_live_ones_is_not(tmp_path):
    import subprocess
    import sys
    lock = tmp_path / "build.lock"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for held_by in (dead.stdout.strip(), "not a pid", ""):
        lock.write_text(held_by)
        assert take_lock(lock) and lock.read_text() == str(os.getpid())
    assert not take_lock(lock) and lock.read_text() == str(os.getpid())   # held (by this live process)
    lock.unlink()
    assert take_lock(lock)


def test_a_build_finding_a_live_builders_lock_waits_for_it(nets, tmp_path, monkeypatch):
    """The build returns BUSY; the front end waits while the lock is held and builds itself
    once it is gone without the libraries (here stopped at once: ``close``)."""
    _, _, checksum = nets
    lock = tmp_path / "build.lock"
    lock.write_text(str(os.getpid()))                                     # this process: alive
    assert build_packages("MSD_musicnn", "float32", [16], 1, tmp_path) == BUSY
    assert not list(tmp_path.glob("*.pt2")) and lock.exists()
    monkeypatch.setenv("NYSTREAM_PUSH_CACHE", str(tmp_path))
    pushes = CompiledPushes("MSD_musicnn", checksum, (16,))
    deadline = time.monotonic() + 120
    while pushes.status == "building" and time.monotonic() < deadline:
        time.sleep(0.2)
        pushes.get(16)
    assert pushes.status == "waiting" and pushes.get(16) is None          # its subprocess found the lock
    pushes.next_look = 0.0
    assert pushes.get(16) is None and pushes.status == "waiting"
    lock.unlink()                                                         # the other builder ended, nothing built
    pushes.next_look = 0.0
    pushes.get(16)
    assert pushes.status == "building" and pushes.build is not None
    pushes.close()
    assert pushes.build.poll() == -9


def test_the_front_end_compiles_one_stream_only_when_one_runs_and_when_asked(tmp_path, monkeypatch):
    """Slots for many streams never start the compiled pushes; the first single stream does,
    and later ones share them; NYSTREAM_COMPILED_PUSH=0 (the suite's, tests/conftest.py) keeps
    every hop eager."""
    from audio.frontends import MusicnnFrontEnd
    from audio.musicnn.graph import STEADY_FRAMES
    assert STEADY_FRAMES == (15, 16)
    fe = MusicnnFrontEnd()
    assert fe.pushes is None and isinstance(fe.stream().net, GraphStream) and fe.pushes is None
    monkeypatch.setenv("NYSTREAM_COMPILED_PUSH", "1")
    monkeypatch.setenv("NYSTREAM_PUSH_CACHE", str(tmp_path))
    fe = MusicnnFrontEnd()
    fe.batch(4)
    assert fe.pushes is None
    first, second = fe.stream(), fe.stream()
    assert fe.pushes is not None and first.net.pushes is fe.pushes and second.net.pushes is fe.pushes
    assert first.net.batch is fe.warm.net.batch is second.net.batch          # the warm-up's tables
    assert fe.pushes.status == "building"
    fe.pushes.close()                                                       # the build it started, stopped
    assert fe.pushes.build.poll() == -9
