"""The offline jobs on a two-node Ray cluster (ray.cluster_utils.Cluster: a head and a second
node, one CPU each, on this machine): extraction equals one process bit for bit, and a
two-configuration `sweep` on Ray Tune gives the same accuracies as the sweep in one process.
The sweep in one process also resumes: a rerun trains nothing that is already saved."""
import json
import shutil
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from app.cli import main  # noqa: E402
from app.offline.extract import extract_gtzan  # noqa: E402
from app.offline.ray_cluster import ROOT, ray_session  # noqa: E402
from app.offline.ray_extract import FrontEndSpec, RayJob  # noqa: E402
from audio.token_cache import convert_musicnn, save_tokens  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
pytestmark = [pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data not found at {DATA}"),
              pytest.mark.shared, pytest.mark.xdist_group("ray")]    # one Ray instance at a time


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                           "object_store_memory": 150 * 2**20})
    cluster.add_node(num_cpus=1, object_store_memory=150 * 2**20)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_extract_on_two_nodes_equals_one_process(tmp_path):
    folder = tmp_path / "gtzan"
    folder.mkdir()
    for name in ("blues.00000.wav", "metal.00000.wav", "pop.00000.wav", "reggae.00000.wav"):
        shutil.copy(DATA / "gtzan_excerpts" / name, folder / name)
    spec = FrontEndSpec("musicnn")
    extract_gtzan(folder, tmp_path / "one.npz", spec.build(), log=lambda s: None)
    with ray_session():
        extract_gtzan(folder, tmp_path / "ray.npz", spec.build(), log=lambda s: None,
                      ray=RayJob(spec, workers=2))
    assert (tmp_path / "ray.npz").read_bytes() == (tmp_path / "one.npz").read_bytes()


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


def test_a_sweep_on_ray_tune_equals_the_sweep_in_one_process(musicnn_tokens, tmp_path):
    one, on_ray = tmp_path / "one", tmp_path / "ray"
    assert sweep(musicnn_tokens, one) == 0
    assert sweep(musicnn_tokens, on_ray, "--ray", "--workers", "2") == 0
    assert len(list((on_ray / "checkpoints").glob("*.pt"))) == 2
    assert accuracies(on_ray) == accuracies(one) and len(accuracies(one)) == 2
    stamps = {p.name: p.stat().st_mtime_ns for p in (one / "checkpoints").glob("*.pt")}
    assert sweep(musicnn_tokens, one) == 0                       # resumes: nothing to train
    assert {p.name: p.stat().st_mtime_ns for p in (one / "checkpoints").glob("*.pt")} == stamps
