"""`serve --ray`: the same app as a Ray Serve deployment of 2 replicas (the code shipped in the
job's working_dir), on a real local Ray instance with direct ingress (the edge relays to each
replica's own port) and on a two-node ray.cluster_utils.Cluster through Ray Serve's proxy, on a
Serve that already ran with HTTP options of its own. Health sums the replicas and says their
split; each client's records equal `classify FILE --jsonl`; a killed replica cuts only its own
client's stream."""
import json
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
    cluster, env = None, pytest.MonkeyPatch()
    if request.param == "local":                 # as `serve --ray local` starts it: direct ingress
        for key, value in ray_serve.DIRECT_INGRESS.items():
            env.setenv(key, value)
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
        # Serve already running with HTTP options of its own (as on a cluster that serves other
        # apps): serve.start ignores the port `start` asks for, and the edge relays to this one.
        # Started as on a host too loaded for Ray's own wait for the proxy (cut to 10 ms here):
        # start_serve waits on for it
        import ray.serve._private.api as serve_api
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(serve_api, "HTTP_PROXY_TIMEOUT", 0.01)
            ray_serve.start_serve({"host": "127.0.0.1", "port": ray_serve.free_loopback_port()})
        # one stream per replica: a second client is refused (1013) and lands on the other one
        spec = HubSpec(FrontEndSpec("musicnn"), 1, tuple(checkpoints))
        yield ray_serve.start(spec, None, "127.0.0.1", port, 2, cpus_per_replica=0.5 if cluster is None else 1.0), port
    finally:
        Edge.stop()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        env.undo()


def health(port) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=30).read())


def test_health_says_how_the_streams_are_split_over_the_replicas(deployed, request):
    """Two clients at the same moment, a stream per replica (a full one refuses 1013 and the
    client asks again): health's split is one on each replica, busiest first. Locally the edge
    relays to the replicas' own ports (Ray Serve's direct ingress, as `serve --ray local` starts
    it); on the two-node cluster, started without it, to Ray Serve's proxy."""
    url, port = deployed
    local = request.node.callspec.params["deployed"] == "local"
    deadline = time.monotonic() + 20                       # (read from the controller every second)
    while Edge.running.upstreams()[1] != local and time.monotonic() < deadline:
        time.sleep(0.2)
    addresses, direct = Edge.running.upstreams()
    assert (direct, len(addresses)) == ((True, 2) if local else (False, 1)), addresses
    assert health(port)["ingress"] == ("direct" if local else "proxy")
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
    replica = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("SERVE_REPLICA::") and a["namespace"] == "serve")
    ray.kill(ray.get_actor(replica["name"], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=60)
    cut = [g for g in got if g["close"] != 1000]
    whole = [g for g in got if g["close"] == 1000]
    assert len(cut) == 1 and len(whole) == 1, [g["close"] for g in got]
    assert cut[0]["close"] == 1012, cut[0]["close"]     # the edge says so (the replica's socket, or the proxy, drops it without a close frame)
    assert "replica serving this stream stopped" in cut[0]["reason"]
    assert cut[0]["verdict"] is None and len(cut[0]["records"]) < len(want)
    same(errors, whole[0]["records"], want)
    assert whole[0]["verdict"]["hops"] == len(want)
    # health sums the live replicas' counts: once the killed one is stale, the survivor's records
    deadline = time.monotonic() + 15
    while health(port)["stream_hops"] != len(want) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert health(port)["stream_hops"] == len(want)
    # and a new client gets a stream (the survivor's, or the replacement's once it runs)
    fresh = {}
    stream(accepted(url), hops[:4], fresh, 0.0)
    assert fresh["close"] == 1000 and fresh["verdict"]["hops"] == 4, fresh["close"]
    same(errors, fresh["records"], want[:4])
