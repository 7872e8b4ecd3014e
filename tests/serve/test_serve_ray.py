"""`serve --ray`: engine servers as the 2 replicas of a Ray Serve deployment (the code shipped in
the job's working_dir), the edge relaying to each replica's own port, on a real local Ray
instance and on a two-node ray.cluster_utils.Cluster (a replica on each node). Health sums the
replicas and says their split; each client's records equal `classify FILE --jsonl`; a replica
whose process is killed cuts only its own client's stream, and Ray Serve replaces it."""
import json
import os
import signal
import socket
import threading
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


from app.runtime.frontend_args import FrontEndSpec  # noqa: E402
from app.serve import ray_serve  # noqa: E402
from app.serve.edge import Edge  # noqa: E402
from app.serve.spec import HubSpec  # noqa: E402
from audio.sources import FileSource  # noqa: E402
from test_serve import classify_jsonl, same  # noqa: E402
from ws_clients import accepted, stream  # noqa: E402


@pytest.fixture(scope="module", params=["local", "two nodes"])
def deployed(files, request):
    """The deployment on a local Ray instance (2 CPUs, half a CPU a replica), or on a
    ray.cluster_utils.Cluster of two nodes on this machine (a CPU each and a CPU a replica: one
    replica on each node, the code reaching the second through the job's working_dir)."""
    checkpoints, _ = files
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cluster = None
    if request.param == "local":
        ray.init(address="local", num_cpus=2, namespace=ray_serve.NAMESPACE, runtime_env=ray_serve.runtime_env(),
                 include_dashboard=False, log_to_driver=False, object_store_memory=256 * 2**20)
    else:
        from ray.cluster_utils import Cluster
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                               "object_store_memory": 150 * 2**20})
        cluster.add_node(num_cpus=1, object_store_memory=150 * 2**20)
        ray.init(address=cluster.address, namespace=ray_serve.NAMESPACE, runtime_env=ray_serve.runtime_env(),
                 log_to_driver=False)
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    try:
        # one stream per replica: a second client is refused (1013) and lands on the other one
        spec = HubSpec(FrontEndSpec("musicnn"), 1, tuple(checkpoints))
        yield ray_serve.start(spec, None, "127.0.0.1", port, 2, cpus_per_replica=0.5 if cluster is None else 1.0), port
    finally:
        Edge.stop()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def health(port) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=30).read())


def test_health_says_how_the_streams_are_split_over_the_replicas(deployed):
    """Two clients at the same moment, a stream per replica (the edge sends each new stream to
    the replica with the fewest of its streams): health's split is one on each replica, busiest
    first. Both replicas listen on loopback (their nodes are this machine) in two processes."""
    url, port = deployed
    addresses = Edge.running.upstreams.addresses()
    assert len(addresses) == 2 and all(a.startswith("127.0.0.1:") for a in addresses), addresses
    assert len(set(Edge.running.upstreams.pids)) == 2
    joined, held = [], threading.Barrier(3)

    def join():
        ws = accepted(url)
        joined.append(ws)
        held.wait(timeout=120)                             # both open until the split is read
        ws.close()
    threads = [threading.Thread(target=join) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 90
    while len(joined) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)                                        # each replica's next health report
    split = health(port)["streams_by_replica"]
    held.wait(timeout=120)
    for t in threads:
        t.join(timeout=60)
    assert len(joined) == 2 and split == [1, 1], (len(joined), split)
    deadline = time.monotonic() + 15
    while health(port)["active_streams"] and time.monotonic() < deadline:
        time.sleep(0.2)


def test_two_replicas_a_killed_one_cuts_only_its_stream(deployed, files, capsys, errors):
    url, port = deployed
    checkpoints, songs = files
    want = classify_jsonl(capsys, songs["a"], checkpoints)
    h = health(port)
    assert (h["replicas"], h["capacity"], len(h["models"])) == (2, 2, 2)
    hops = list(FileSource(songs["a"]))
    clients = [accepted(url), accepted(url)]                 # one on each replica
    deadline = time.monotonic() + 10
    while health(port)["active_streams"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert health(port)["active_streams"] == 2
    got = [{}, {}]
    threads = [threading.Thread(target=stream, args=(ws, hops, g, 0.25)) for ws, g in zip(clients, got)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(Edge.running.upstreams.pids[0], signal.SIGKILL)     # a replica's process dies
    for t in threads:
        t.join(timeout=60)
    cut = [g for g in got if g["close"] != 1000]
    whole = [g for g in got if g["close"] == 1000]
    assert len(cut) == 1 and len(whole) == 1, [g["close"] for g in got]
    assert cut[0]["close"] == 1012, cut[0]["close"]     # the edge says so (the replica's socket drops without a close frame)
    assert "replica serving this stream stopped" in cut[0]["reason"]
    assert cut[0]["verdict"] is None and len(cut[0]["records"]) < len(want)
    same(errors, whole[0]["records"], want)
    assert whole[0]["verdict"]["hops"] == len(want)
    # health sums the live replicas' counts: once the killed one is stale, the survivor's records
    deadline = time.monotonic() + 15
    while health(port)["stream_hops"] != len(want) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert health(port)["stream_hops"] == len(want)
    # a new client gets a stream (the survivor's, or the replacement's once it runs)
    fresh = {}
    stream(accepted(url), hops[:4], fresh, 0.0)
    assert fresh["close"] == 1000 and fresh["verdict"]["hops"] == 4, fresh["close"]
    same(errors, fresh["records"], want[:4])
    # and Ray Serve replaces the dead replica: two replicas serve again
    deadline = time.monotonic() + 120
    while health(port)["replicas"] < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert health(port)["replicas"] == 2
