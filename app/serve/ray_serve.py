"""`serve --ray [ADDRESS] --replicas K`: the same ASGI app (app/serve/service.py) as a Ray Serve
ingress deployment of K replicas, each building its own hub (one batched engine) where it runs.

- The public socket is the edge's (app/serve/edge.py), in this process. A WebSocket connection
  stays on one replica for its whole life.
- On a local instance (`--ray local`) Ray Serve runs direct ingress: each replica serves HTTP on a
  loopback port of its own, and the edge relays each new stream to the replica holding the fewest
  of its streams. The ports are read from Ray Serve's controller every REFRESH_S (``Upstreams``).
  No proxy is in the data path: at 32 clients on 2 cores Ray Serve's proxy took about a quarter
  of a core (docs/serve.md).
- On a cluster (ADDRESS), as the cluster runs Serve: with direct ingress and the replicas on this
  node, as above; else through Ray Serve's proxy on a loopback port, whose router picks the
  replica by its view of the replicas' ongoing requests. That is not always even, so a full
  replica answers 1013 while another may have room, and `listen` asks again.
- The code and the shipped assets reach every node through the job's runtime environment
  (``working_dir``: this project's files, minus what .gitignore and EXCLUDES leave out), not
  through a shared checkout path.
- ``/v1/health`` sums the replicas: each reports its hub's health to a named actor every second;
  a replica silent for 3 s is not counted.
- A replica that dies drops its connections without a close frame; the edge closes each of its
  clients with 1012 and a reason, and `listen` reconnects with a fresh stream. The other
  replicas' clients are not touched.
- SIGTERM or SIGINT drains at the edge, as a plain server drains: no new streams, each stream's
  replica told it has ended, its client given the records of the audio the edge had passed on,
  its verdict and a close 1001 (at most DRAIN_SECONDS; a second signal stops at once).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import ray
from ray import serve

from .protocol import first_line, health_sums
from .server import host_port

ROOT = Path(__file__).resolve().parents[2]
APP = "nystream"
REGISTRY = "nystream-serve-registry"
NAMESPACE = "nystream"
EXCLUDES = [".git", ".venv", "tests", "docs", "scripts", "bench_results", "*.egg-info", "__pycache__"]
STALE_S = 3.0
PROXY_WAIT_S = 300.0          # serve.start's wait for Ray Serve's HTTP proxy (Ray's own: 60 s)
REFRESH_S = 1.0               # how often the edge asks Ray Serve's controller where the replicas listen
# Ray Serve's settings on a local instance. Direct ingress: each replica of the app serves HTTP on
# a port of its own, no proxy in the data path; a replica being removed drains at once (the edge
# drains its clients itself). The app's code on the replica's own event loop, not a second one's
# (Ray Serve's throughput setting; the engine's hops run on threads of their own either way)
DIRECT_INGRESS = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
                  "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
_registry = None


@ray.remote(num_cpus=0)
class Registry:
    """Each replica's last health, by replica."""

    def __init__(self):
        self.seen: dict[str, tuple[float, dict]] = {}

    def report(self, replica: str, health: dict) -> None:
        self.seen[replica] = (time.monotonic(), health)

    def total(self) -> dict:
        now = time.monotonic()
        alive = [h for t, h in self.seen.values() if now - t <= STALE_S]
        sums, split = health_sums(alive)
        return {"replicas": len(alive), **sums, "streams_by_replica": split}


class RayPeers:
    """What a replica's app uses to report itself and read the sum (service.build_app(peers=))."""

    def __init__(self):
        self.registry = ray.get_actor(REGISTRY, namespace=NAMESPACE)
        self.me = serve.get_replica_context().replica_id.unique_id

    async def report(self, health: dict) -> None:
        await self.registry.report.remote(self.me, health)

    async def total(self) -> dict:
        return await self.registry.total.remote()


class Upstreams:
    """Where the edge sends a new stream (app/serve/edge.py ``as_upstreams``): the replicas' own
    ports where Ray Serve runs direct ingress and they are on this node, else the proxy at
    ``proxy``. Asked of Ray Serve's controller every REFRESH_S, on a thread, so that a replaced
    replica's new port is used and a dead one's dropped; until the first answer, the proxy."""

    def __init__(self, proxy: str):
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
        self.proxy, self.current = proxy, ([proxy], False)
        self.controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        self.here = {ray.util.get_node_ip_address(), "127.0.0.1", "localhost"}
        self.stopped = threading.Event()
        self.refresh()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="nystream-upstreams")
        self.thread.start()

    def __call__(self) -> tuple[list[str], bool]:
        return self.current

    def refresh(self) -> None:
        from ray.serve._private.common import RequestProtocol
        if not ray.is_initialized():
            return
        try:
            groups = ray.get(self.controller.get_target_groups.remote(APP), timeout=10)
        except Exception:  # noqa: BLE001 - the controller busy or restarting: what was known stays
            return
        replicas = [t for g in groups if g.app_name == APP and g.protocol == RequestProtocol.HTTP for t in g.targets]
        if replicas and all(t.ip in self.here for t in replicas):      # they listen on loopback (``start``)
            self.current = (sorted(f"127.0.0.1:{t.port}" for t in replicas), True)
        else:
            self.current = ([self.proxy], False)

    def _loop(self) -> None:
        while not self.stopped.wait(REFRESH_S):
            self.refresh()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=15)


def ingress(spec, token: str | None, version: str):
    """The deployment class: its replicas build the app (and so their hub) when they start."""
    def build():
        from .service import build_app
        return build_app(spec.build, token=token, limits=spec.limits, version=version, peers=RayPeers())
    return serve.ingress(build)()


def start(spec, token: str | None, host: str, port: int, replicas: int, *, cpus_per_replica: float = 1.0) -> str:
    """Deploy on the connected Ray (``ray.init`` done by the caller), Ray Serve's HTTP on
    loopback (its proxy on a port of its own, or where it already listens: ``proxy_address``;
    under direct ingress each replica on its own), and the edge (app/serve/edge.py) on
    ``host:port``, relaying to ``Upstreams``; the stream's URL."""
    from .edge import Edge
    from .server import bind, package_version
    ours = package_version()
    public = bind(host, port)                        # ServeError (one line) when it cannot be had
    global _registry                 # held here: an actor without a handle is gone
    _registry = Registry.options(name=REGISTRY, namespace=NAMESPACE, get_if_exists=True).remote()
    start_serve({"host": "127.0.0.1", "port": free_loopback_port()})
    inner = proxy_address()
    deployment = serve.deployment(ingress(spec, token, ours), name=APP, num_replicas=replicas,
                                  max_ongoing_requests=spec.capacity + 8,
                                  ray_actor_options={"num_cpus": cpus_per_replica})
    serve.run(deployment.bind(), name=APP, route_prefix="/")
    Edge.start(Upstreams(inner), public, spec.limits.message_bytes)   # the one of this process
    return f"ws://{host_port(host, public.getsockname()[1])}/v1/stream"


def start_serve(http_options: dict) -> None:
    """``serve.start``, waiting for its HTTP proxy past Ray's own fixed 60 s, up to PROXY_WAIT_S
    in all: on a loaded host the proxy's process can take longer to start (Ray then raises, with
    its controller running; a second ``serve.start`` connects to it)."""
    t0 = time.monotonic()
    try:
        serve.start(http_options=http_options)
        return
    except TimeoutError:                  # "HTTP proxies not available after 60s."
        serve.start(http_options=http_options)
    inner = proxy_address()
    while True:
        try:
            urllib.request.urlopen(f"http://{inner}/-/healthz", timeout=5).read()
            return
        except urllib.error.HTTPError:     # it answers (503 until an application runs)
            return
        except OSError:
            if time.monotonic() - t0 > PROXY_WAIT_S:
                from .server import ServeError
                raise ServeError(f"Ray Serve's HTTP proxy did not start within {PROXY_WAIT_S:.0f} s") from None
            time.sleep(0.5)


def free_loopback_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def proxy_address() -> str:
    """Where this node's Ray Serve proxy listens ("HOST:PORT"): the loopback port ``start`` asked
    for, or, where Serve already ran in the cluster (its HTTP options then stay as they were,
    and ``serve.start`` ignores ours), the port it was given then."""
    from ray.serve.context import _get_global_client      # the running controller's client
    http = _get_global_client().http_config
    host = "127.0.0.1" if http.host in (None, "", "0.0.0.0", "::") else http.host
    return host_port(host, http.port)


def runtime_env() -> dict:
    return {"working_dir": str(ROOT), "excludes": EXCLUDES, "env_vars": {"OMP_NUM_THREADS": "1"}}


def deploy(spec, token: str | None, host: str, port: int, replicas: int, address: str) -> int:
    """`serve --ray`: start (a local Ray, or join ADDRESS), deploy, serve until SIGTERM / SIGINT."""
    from app.runtime.lineup import load_trained
    from models.checkpoint import CheckpointError
    for path in spec.checkpoints:       # here first: a replica's failure would be Ray's traceback
        try:
            load_trained(path, spec.frontend.name, "cpu")
        except CheckpointError as e:
            raise SystemExit(f"serve: error: {e}") from None
    if address == "local":              # its processes inherit this environment (a set value stays)
        for key, value in DIRECT_INGRESS.items():
            os.environ.setdefault(key, value)
    try:
        ray.init(address=address, namespace=NAMESPACE, runtime_env=runtime_env(),   # "local": a new instance
                 include_dashboard=False, log_to_driver=False, configure_logging=False)
    except Exception as e:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError, ...
        raise SystemExit(f"serve: cannot {'start Ray' if address == 'local' else f'reach the Ray cluster at {address!r}'}: "
                         f"{type(e).__name__}: {first_line(e)}") from None
    from .edge import Edge, signalled
    from .server import ServeError
    stop, hurry = threading.Event(), threading.Event()    # set by signals once the edge serves
    try:
        try:
            url = start(spec, token, host, port, replicas)
        except ServeError as e:
            raise SystemExit(f"serve: {e}") from None
        except RuntimeError as e:       # Ray Serve's "Deploying application ... failed"
            raise SystemExit(f"serve: Ray Serve could not deploy the app ({first_line(e)}); "
                             f"the replicas' errors are in Ray's logs") from None
        way = "direct ingress" if Edge.running.upstreams()[1] else "through Ray Serve's proxy"
        print(f"# serving {url} on Ray Serve: {replicas} replicas of up to {spec.capacity} streams each, {way}"
              f"{', token required' if token else ''}", file=sys.stderr, flush=True)
        stop, hurry = signalled()
        while not stop.is_set():
            time.sleep(0.2)
    finally:
        Edge.finish(stop, hurry)
        if address != "local":          # a cluster that lives on: remove this app from it
            serve.delete(APP)
        ray.shutdown()                  # a local instance: everything ends with it
    print("# stopped", file=sys.stderr, flush=True)
    return 0
