"""The offline jobs on real Ray. `extract --ray` and `accuracy --ray` on a local Ray instance (2
CPUs: one Ray Data worker and a CPU for its reads; class TestLocal) equal the single-process run
bit for bit, through a killed worker, a killed driver and a corrupt file among good ones; on a
two-node ray.cluster_utils.Cluster (a head and a second node, one CPU each; class TestTwoNodes)
extraction equals one process, and a two-configuration `sweep` on Ray Tune gives the accuracies
of the sweep in one process. Oracle: the same command in one process on the same shared data.
Each class holds its own Ray session (in whichever pytest-xdist worker runs it)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import audio_helpers  # noqa: E402

from app.cli import main  # noqa: E402
from app.offline.extract import extract_gtzan  # noqa: E402
from app.offline.ray.cluster import ROOT, RayClusterError, ray_session  # noqa: E402
from app.offline.ray.extract import FrontEndSpec, RayJob  # noqa: E402
from audio.tokens.cache import convert_musicnn, save_tokens  # noqa: E402

SHARED = ROOT.parent / "shared" / "data" / "gtzan_excerpts"
GENRES = ("blues", "classical", "country", "disco", "hiphop", "jazz", "metal", "pop", "reggae", "rock")
DATA = SHARED.parent
pytestmark = [pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared data not found at {SHARED}"),
              pytest.mark.shared]


def runtime_env():
    return {"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}}   # as app/offline/ray/cluster.py


@pytest.fixture(scope="class")
def local_ray():
    # address="local": a new instance of this worker's own, even if another runs on this machine
    ray.init(address="local", num_cpus=2, object_store_memory=200 * 2**20, runtime_env=runtime_env(),
             include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="class")
def two_nodes():
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                           "object_store_memory": 150 * 2**20})
    cluster.add_node(num_cpus=1, object_store_memory=150 * 2**20)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False, runtime_env=runtime_env())
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    yield cluster
    ray.shutdown()
    cluster.shutdown()


SECONDS = 4             # of each excerpt: 2 musicnn tokens, 16 VGGish tokens


def first_seconds(name: str, folder: Path) -> None:
    audio_helpers.first_seconds(SHARED / name, folder, SECONDS)


@pytest.fixture(scope="module")
def excerpts(tmp_path_factory):
    """A dozen tracks: the first seconds of 11 real GTZAN excerpts, and a corrupt file."""
    folder = tmp_path_factory.mktemp("gtzan")
    for name in [f"{g}.00000.wav" for g in GENRES] + ["blues.00001.wav"]:
        first_seconds(name, folder)
    (folder / "jazz.00099.wav").write_bytes(b"RIFF....WAVEfmt not really audio")
    return folder


SPECS = {"musicnn": FrontEndSpec("musicnn"), "vggish": FrontEndSpec("vggish", random_vggish=0)}


@pytest.fixture(scope="module")
def reference(excerpts, tmp_path_factory):
    """The single-process token file of each front end, as bytes."""
    out = {}
    for name, spec in SPECS.items():
        path = tmp_path_factory.mktemp("one") / f"{name}.npz"
        extract_gtzan(excerpts, path, spec.build(), log=lambda s: None)
        out[name] = path.read_bytes()
    return out


def actor_pids(class_fragment):
    """Processes of Ray actors whose title names ``class_fragment`` (Ray titles each worker
    process with its actor, e.g. "ray::MapWorker(MapBatches(TrackTokens))")."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and class_fragment in (proc / "cmdline").read_text():
                pids.append(int(proc.name))
        except OSError:
            pass
    return [p for p in pids if p != os.getpid()]


def skipped_the_corrupt_file(lines) -> bool:
    return any("jazz/jazz.00099.wav: SKIPPED" in line or "jazz.00099.wav: SKIPPED" in line for line in lines)


@pytest.mark.usefixtures("local_ray")
class TestLocal:
    """A local Ray instance, 2 CPUs."""

    def test_extract_on_ray_equals_one_process_bit_for_bit(self, excerpts, reference, tmp_path):
        """VGGish here; musicnn through a killed worker (the next test)."""
        out = tmp_path / "ray.npz"
        lines = []
        with ray_session() as r:
            extract_gtzan(excerpts, out, SPECS["vggish"].build(), log=lines.append,
                          ray=RayJob(SPECS["vggish"], workers=1))
            assert r.is_initialized()
        assert out.read_bytes() == reference["vggish"]
        assert skipped_the_corrupt_file(lines)
        assert not out.with_name(out.name + ".parts").exists()


    def test_a_killed_worker_is_replaced_and_the_tokens_are_the_same(self, excerpts, reference, tmp_path):
        """SIGKILL of the Ray Data worker once the first track is written, or once it has run a
        second (on a busy host the driver may write its first part only after the worker has done
        every track and left): Ray starts another, the tracks in flight are computed again, and
        the musicnn token file is still the single-process one."""
        out = tmp_path / "ray.npz"
        parts = out.with_name(out.name + ".parts")
        killed, lines, seen = [], [], {}

        def killer():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not killed:
                now = time.monotonic()
                for pid in actor_pids("TrackTokens"):
                    if (parts.is_dir() and any(parts.glob("*.npy"))) or now - seen.setdefault(pid, now) >= 1.0:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                time.sleep(0.05)
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        with ray_session():
            extract_gtzan(excerpts, out, SPECS["musicnn"].build(), log=lines.append,
                          ray=RayJob(SPECS["musicnn"], workers=1))
        thread.join(5)
        assert killed, "no worker was killed"
        assert out.read_bytes() == reference["musicnn"]
        assert skipped_the_corrupt_file(lines) and not parts.exists()


    def test_a_killed_driver_loses_only_tracks_in_flight_and_a_rerun_resumes(self, excerpts, reference, tmp_path):
        """The CLI joins this Ray instance by address; it is SIGKILLed once 3 tracks are written. A
        rerun keeps those parts (not recomputed: same files, same inodes) and completes the file."""
        out = tmp_path / "ray.npz"
        parts = out.with_name(out.name + ".parts")
        address = ray.get_runtime_context().gcs_address
        cmd = [sys.executable, str(ROOT / "main.py"), "extract", "--gtzan", str(excerpts), "--out", str(out),
               "--ray", address, "--workers", "1"]
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(list(parts.glob("*.npy"))) < 3 and child.poll() is None:
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        done = len(list(parts.glob("*.npy"))) + len(list(parts.glob("*.skip")))
        assert 3 <= done < 12 and not out.exists(), done
        lines = []
        with ray_session():
            extract_gtzan(excerpts, out, SPECS["musicnn"].build(), log=lines.append,
                          ray=RayJob(SPECS["musicnn"], workers=1))
        assert f"resuming: {done} of 12 tracks already done" in lines, lines[:3]
        assert len([x for x in lines if x.startswith("[")]) == 12 - done      # only the rest computed
        assert out.read_bytes() == reference["musicnn"]


    def test_accuracy_on_ray_equals_one_process(self, excerpts, tmp_path):
        few = tmp_path / "few"
        few.mkdir()
        for p in sorted(excerpts.glob("*.wav"))[:3]:
            shutil.copy(p, few / p.name)
        one, on_ray = tmp_path / "one", tmp_path / "ray"
        assert main(["accuracy", "--audio", str(few), "--out", str(one), "--command-line", "x"]) == 0
        assert main(["accuracy", "--audio", str(few), "--out", str(on_ray), "--command-line", "x",
                     "--ray", "--workers", "1"]) == 0
        assert (on_ray / "accuracy.json").read_text() == (one / "accuracy.json").read_text()
        assert (on_ray / "accuracy.md").read_text() == (one / "accuracy.md").read_text()
        assert not (on_ray / "accuracy.parts").exists()


    def test_an_unreachable_cluster_is_one_line_and_writes_nothing(self, excerpts, tmp_path, capsys):
        out = tmp_path / "x.npz"
        r = subprocess.run([sys.executable, str(ROOT / "main.py"), "extract", "--gtzan", str(excerpts),
                            "--out", str(out), "--ray", "127.0.0.1:1"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("error: cannot reach the Ray cluster at '127.0.0.1:1'")
        assert not out.exists()


    def test_workers_that_cannot_import_the_code_are_one_error(self):
        """The check that refuses a cluster without the project's code, on a real worker asked to
        import a module no node has."""
        with pytest.raises(RayClusterError, match=r"cannot run Nystream's code \(ModuleNotFoundError"):
            with ray_session(modules=("nystream_not_installed_here",)):
                pass


@pytest.fixture(scope="module")
def musicnn_tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "musicnn.npz"
    save_tokens(path, convert_musicnn(DATA / "gtzan_musicnn_tokens"))
    return path


def sweep(tokens, out, *extra):
    return main(["sweep", "--tokens", str(tokens), "--out", str(out), "--variants", "continual,continual_nystrom",
                 "--layers", "1", "--seeds", "0", "--no-fixed", "--epochs", "2", "--lr", "1e-3",
                 "--d-model", "32", "--heads", "4", "--ff-dim", "64", *extra])


def accuracies(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    return {m["summary"]["name"]: m["summary"]["accuracies"] for m in report["models"]}


def stamps(out: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints").glob("*.pt")}


@pytest.mark.usefixtures("two_nodes")
class TestTwoNodes:
    """A head and a second node, one CPU each, on this machine."""

    def test_extract_on_two_nodes_equals_one_process(self, tmp_path):
        folder = tmp_path / "gtzan"
        folder.mkdir()
        for name in ("blues.00000.wav", "metal.00000.wav", "pop.00000.wav", "reggae.00000.wav"):
            first_seconds(name, folder)
        spec = FrontEndSpec("musicnn")
        extract_gtzan(folder, tmp_path / "one.npz", spec.build(), log=lambda s: None)
        with ray_session():
            extract_gtzan(folder, tmp_path / "ray.npz", spec.build(), log=lambda s: None,
                          ray=RayJob(spec, workers=2))
        assert (tmp_path / "ray.npz").read_bytes() == (tmp_path / "one.npz").read_bytes()


    def test_a_sweep_on_ray_tune_equals_the_sweep_in_one_process(self, musicnn_tokens, tmp_path, capsys):
        one, on_ray = tmp_path / "one", tmp_path / "ray"
        assert sweep(musicnn_tokens, one) == 0
        assert sweep(musicnn_tokens, on_ray, "--ray", "--workers", "2") == 0
        assert len(stamps(on_ray)) == 2 and len(list((on_ray / "tune").glob("sweep-*"))) == 1
        assert accuracies(on_ray) == accuracies(one) and len(accuracies(one)) == 2
        # rerun: the one-process sweep trains nothing saved; on Ray the grid's experiment is restored
        before = stamps(one), stamps(on_ray)
        capsys.readouterr()
        assert sweep(musicnn_tokens, one) == 0 and sweep(musicnn_tokens, on_ray, "--ray", "--workers", "2") == 0
        assert "restoring this grid's Ray Tune experiment" in capsys.readouterr().err
        assert (stamps(one), stamps(on_ray)) == before and accuracies(on_ray) == accuracies(one)
