"""Shared test set-up. Tests live by area (models/, audio/, app/, gui/); helpers shared across
areas (audio_helpers, reference, tiny) live beside this file.

Markers, applied here so that they cannot be forgotten:
  shared   uses ../shared/data (skips cleanly when it is absent)
  jack     drives a real PortAudio input through a JACK dummy server
  display  opens a real X11 window under Xvfb
  gui      a Qt window (offscreen)
  slow     long property tests
`make test` runs everything, in pytest-xdist workers, a module's tests in one worker (``--dist
loadfile``: costly module-scoped set-up, a Ray session and its single-process reference or the
ONNX exports, is made once); `make test-fast` deselects shared, jack, display, gui and slow.
Modules are handed out in FIRST's order (below): the window beside modules that wait more than
they compute, then the longest, so that no worker is left with a long one at the end.

No assertion depends on the host's speed: timing mechanisms are checked with injected clocks or
the source's own clock, and real-time outcomes (drops, delays) are measured by `bench`.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.append(str(HERE))          # after ROOT: the packages app/, audio/, models/ win
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# every hop eager: no test builds the compiled push in the background (its own tests build it,
# into a directory of their own: tests/audio/test_musicnn_graph.py); subprocesses inherit this
os.environ["NYSTREAM_COMPILED_PUSH"] = "0"
# one torch thread per pytest-xdist worker (the workers share the cores), up to 2 otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

SHARED = ROOT.parent / "shared" / "data"


def pytest_configure(config):
    """The models' compiled kernels in numba's cache before any worker starts (`make test`'s
    `prepare` has usually built them): every engine then loads them before its first hop, so
    that its records do not depend on when a background build ends (tests/app/test_first_start.py
    tests that case on its own)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    config.option.loadscopereorder = False     # FIRST's order (below), not xdist's by count of tests
    from models.fused import available
    if available():
        from app.runtime.kernels import prepare
        prepare()


@pytest.fixture(autouse=True)
def torch_threads():
    """Every test starts with the worker's torch threads: code run in the test's process (a
    bench, a command) may set its own and not set them back, and a later test would then run, or
    build a compiled push, for that count."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def shared_data():
    if not SHARED.is_dir():
        pytest.skip(f"shared data not found at {SHARED}")
    return SHARED


# The order modules are handed to the workers: first the window (two cores' worth of threads at
# 4x) beside three that mostly wait on a clock or a socket (JACK, the WebSocket service, the
# browser), then the longest first, so that no worker is left with a long one at the end.
FIRST = ("test_gui.py", "test_microphone_jack.py", "test_serve.py", "test_page.py",
         "test_ray.py", "test_onnx_export.py", "test_serve_ray.py", "test_fused.py", "test_sda_equality.py",
         "test_hostile_clients.py", "test_machine_faults.py", "test_bench.py", "test_sda_stability.py",
         "test_audio_musicnn.py", "test_serve_workers.py", "test_musicnn_batch.py", "test_musicnn_precision.py",
         "test_classify_cli.py", "test_gtzan_data.py", "test_audio_frontend.py", "test_train_evaluate.py",
         "test_engine_process.py", "test_stream_batch.py", "test_musicnn_graph.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(FIRST)))   # stable
    for item in items:
        path = Path(str(item.fspath))
        if "shared_data" in getattr(item, "fixturenames", ()) or "shared_tokens" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.shared)
        if path.name == "test_microphone_jack.py":
            item.add_marker(pytest.mark.jack)
        if "xvfb" in item.name:
            item.add_marker(pytest.mark.display)
        if path.parent.name == "gui":
            item.add_marker(pytest.mark.gui)


# ------------------------------------------------------------------ tolerance margins
# Every float tolerance of the suite is checked through the ``errors`` fixture: it asserts the
# observed error is within its tolerance and, with ``--margins FILE``, appends (name, tolerance,
# observed) to FILE. ``--seeds N`` runs every test that takes the ``seed`` fixture on seeds
# 0..N-1. `make tolerances` runs both (20 seeds) and prints each tolerance's worst observed value
# and its margin (scripts/tolerance_margins.py); the default run takes seed 0.

def pytest_addoption(parser):
    parser.addoption("--seeds", type=int, default=1, help="run seeded tolerance tests on seeds 0..N-1")
    parser.addoption("--margins", default=None, help="append each tolerance check to this JSON-lines file")


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames:
        metafunc.parametrize("seed", range(metafunc.config.getoption("--seeds")))


class Errors:
    """``errors(name, observed, tolerance)``: assert observed <= tolerance, and record it."""

    def __init__(self, path):
        self.path = path

    def __call__(self, name: str, observed: float, tolerance: float, where="") -> None:
        if self.path:
            import json
            with open(self.path, "a") as f:
                f.write(json.dumps({"name": name, "tolerance": tolerance, "observed": observed}) + "\n")
        assert observed <= tolerance, f"{name}: error {observed:.3g} > tolerance {tolerance:.3g} {where}"


@pytest.fixture
def errors(request):
    return Errors(request.config.getoption("--margins"))


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (needs root, as CI runs), filled to all but ``room`` bytes by ``fill``."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?)")

    def fill(room: int) -> None:
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        with open(mount / "filler", "wb") as f:
            f.write(b"\0" * max(0, free - room))
    try:
        yield mount, fill
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
