"""`bench --serve`: the real `serve` in its own process and loopback clients streaming in real
time; what it reports follows from what the clients got, and the server's cores are split by
process (with Ray: its replicas, proxy, controller and Ray's own servers, by command line)."""
import subprocess
import sys

import pytest

from app.bench.serve import role_of, roles_line, serve_bench


def test_the_serve_bench_counts_every_hop_and_splits_the_cores_by_process():
    seconds, clients = 2.0, 2
    r = serve_bench(clients, seconds)
    hops = int(seconds / 0.25)
    assert r["hops_sent"] == clients * hops
    assert r["records"] == r["hops_sent"] and r["dropped"] == 0      # the server drops no hop: it queues them
    assert r["verdicts"] == clients
    assert 0 < r["latency_ms_median"] <= r["latency_ms_p95"] < float("inf")
    roles = r["server_cores_by_role"]
    assert roles["the serve process"] > 0 and r["client_cores"] > 0
    assert r["server_cores"] == pytest.approx(sum(roles.values()))
    assert roles_line(r).startswith("server cores by process: the serve process ")
    assert 1 <= r["streams_per_engine_hop"] <= clients                 # the server's own counts (health)


@pytest.mark.parametrize("title, role", [("ray::ServeReplica:default:Classifier", "replicas"),
                                         ("ray::ProxyActor", "Ray Serve's proxy"),
                                         ("/venv/lib/ray/core/src/ray/raylet/raylet --node_id=1", "raylet"),
                                         ("ray::IDLE", "other Ray processes"),
                                         ("from multiprocessing.spawn import spawn_main; spawn_main()", "workers")])
def test_a_process_of_the_tree_is_named_by_its_command_line(title, role):
    child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)", title],
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()                          # its command line is the one given from here on
        assert role_of(child.pid, server=0) == role
        assert role_of(child.pid, server=child.pid) == "the serve process"
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert role_of(child.pid, server=0) == "processes that ended"    # gone: nothing to read


def test_a_compiled_form_built_beside_the_server_is_named_so():
    for module, role in (("app.runtime.kernels", "compiled-kernel builds"), ("audio.musicnn.graph", "compiled-push builds")):
        child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)", "-m", module],
                                 stdout=subprocess.PIPE)
        try:
            child.stdout.readline()
            assert role_of(child.pid, server=0) == role
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
