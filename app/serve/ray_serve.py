"""`serve --ray [ADDRESS] --replicas K`: K engine servers as the replicas of a Ray Serve
deployment, through the public APIs of Ray Serve (``serve.start``, ``serve.deployment``,
``serve.run``, ``serve.delete``) and Ray (named actors, ``ray.util.get_node_ip_address``).

- Each replica (``EngineReplica``) builds its hub (one batched engine) where it runs and serves
  the plain app (app/serve/service.py) with uvicorn on a port of its own, on a thread of its own:
  on loopback where its node is the edge's, else on its node's address. It takes only the edge's
  secret token and has the limits of a server behind the edge (the edge holds the per-address
  caps). Ray Serve places, health-checks (``check_health``) and replaces the replicas; no Ray
  Serve proxy is started, and no stream passes through Ray.
- Each replica reports its address to a named actor (``Registry``) every REPORT_S. The edge
  (app/serve/edge.py: in this process, on the public socket) reads the live ones every REPORT_S
  (one silent for STALE_S is not used), sends each new stream to the replica holding the fewest
  of its streams, and sums their ``/v1/health``.
- The code and the shipped assets reach every node through the job's runtime environment
  (``working_dir``: this project's files, minus what .gitignore and EXCLUDES leave out), not
  through a shared checkout path.
- A replica that dies drops its connections without a close frame; the edge closes each of its
  clients with 1012 and a reason, and `listen` reconnects with a fresh stream. The other
  replicas' clients are not touched.
- SIGTERM or SIGINT drains at the edge, as a plain server drains (at most DRAIN_SECONDS; a
  second signal stops at once).
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import threading
import time
import uuid
from pathlib import Path

import ray
from ray import serve

from .protocol import first_line
from .server import host_port

ROOT = Path(__file__).resolve().parents[2]
APP = "nystream"
REGISTRY = "nystream-serve-registry"
NAMESPACE = "nystream"
EXCLUDES = [".git", ".venv", "tests", "docs", "scripts", "bench_results", "*.egg-info", "__pycache__"]
REPORT_S = 1.0                # how often a replica says where it listens, and the edge reads it
STALE_S = 3.0                 # a replica silent this long is not sent new streams
START_S = 300.0               # the longest a replica's server may take to load its models
_registry = None


@ray.remote(num_cpus=0)
class Registry:
    """Where each replica listens (and its process), as it last said."""

    def __init__(self):
        self.seen: dict[str, tuple[float, str, int]] = {}

    def report(self, replica: str, address: str, pid: int) -> None:
        self.seen[replica] = (time.monotonic(), address, pid)

    def live(self) -> list[dict]:
        """The replicas heard from within STALE_S: {"address": "HOST:PORT", "pid"}."""
        now = time.monotonic()
        return [{"address": a, "pid": pid} for t, a, pid in self.seen.values() if now - t <= STALE_S]


class EngineReplica:
    """A replica: the app with its own hub on its own port, reported to the Registry."""

    def __init__(self, spec, token: str, edge_node: str):
        from .server import LoopServer, bind, package_version, uvicorn_config
        from .service import build_app
        node = ray.util.get_node_ip_address()
        host = "127.0.0.1" if node == edge_node else node      # beyond loopback: the token still guards it
        sock = bind(host, 0)
        app = build_app(spec.build, token=token, limits=spec.limits, version=package_version(),
                        loopback=host == "127.0.0.1")
        self.server = LoopServer(uvicorn_config(app, spec.limits, 2 * spec.capacity, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="nystream-replica")
        self.thread.start()
        deadline = time.monotonic() + START_S
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.server.started:
            raise RuntimeError("the replica's server did not start (its models failed to load, or took too long)")
        self.address = host_port(host, sock.getsockname()[1])
        self.registry, self.me = ray.get_actor(REGISTRY, namespace=NAMESPACE), uuid.uuid4().hex
        self.registry.report.remote(self.me, self.address, os.getpid())
        threading.Thread(target=self._report, daemon=True, name="nystream-report").start()

    def _report(self) -> None:
        while self.thread.is_alive():
            time.sleep(REPORT_S)
            try:
                self.registry.report.remote(self.me, self.address, os.getpid())
            except Exception:  # noqa: BLE001 - the registry restarting: the next report
                pass

    def check_health(self) -> None:
        """Ray Serve's health check: the server thread runs."""
        if not self.thread.is_alive():
            raise RuntimeError("the replica's server stopped")


class Replicas:
    """The edge's upstreams (``edge.Fixed``'s members): the live replicas' addresses, read from
    the Registry every REPORT_S on a thread of their own."""
    noun = "replicas"

    def __init__(self, registry):
        self.registry, self.current, self.pids = registry, [], []
        self.stopped = threading.Event()
        self.refresh()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="nystream-replicas")
        self.thread.start()

    def addresses(self) -> list[str]:
        return list(self.current)

    def refresh(self) -> None:
        if not ray.is_initialized():
            return
        try:
            live = ray.get(self.registry.live.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the registry busy or restarting: what was known stays
            return
        self.current = sorted(r["address"] for r in live)
        self.pids = sorted(r["pid"] for r in live)

    def _loop(self) -> None:
        while not self.stopped.wait(REPORT_S):
            self.refresh()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=15)


def start(spec, token: str | None, host: str, port: int, replicas: int, *, cpus_per_replica: float = 1.0,
          public=None) -> str:
    """Deploy on the connected Ray (``ray.init`` done by the caller) and start the edge
    (app/serve/edge.py) on ``host:port``; the stream's URL once every replica serves."""
    from .edge import Edge
    from .server import Public, bind
    public = public or Public()
    sock = bind(host, port)                          # ServeError (one line) when it cannot be had
    secret = secrets.token_urlsafe(32)               # the replicas' token: only the edge holds it
    global _registry                                 # held here: an actor without a handle is gone
    _registry = Registry.options(name=REGISTRY, namespace=NAMESPACE, get_if_exists=True).remote()
    serve.start(proxy_location="Disabled")           # (where Serve already runs, it stays as it is)
    inner = dataclasses.replace(spec, limits=spec.limits.behind_edge())
    deployment = serve.deployment(EngineReplica, name=APP, num_replicas=replicas,
                                  ray_actor_options={"num_cpus": cpus_per_replica})
    serve.run(deployment.bind(inner, secret, ray.util.get_node_ip_address()), name=APP, route_prefix=None)
    upstreams = Replicas(_registry)
    deadline = time.monotonic() + 30
    while len(upstreams.addresses()) < replicas and time.monotonic() < deadline:
        time.sleep(0.2)
        upstreams.refresh()
    Edge.start(upstreams, sock, spec.limits, replicas * spec.capacity, token, secret, public)   # the one of this process
    return public.stream_url(host_port(host, sock.getsockname()[1]))


def runtime_env() -> dict:
    return {"working_dir": str(ROOT), "excludes": EXCLUDES, "env_vars": {"OMP_NUM_THREADS": "1"}}


def deploy(spec, token: str | None, host: str, port: int, replicas: int, address: str, public=None) -> int:
    """`serve --ray`: start (a local Ray, or join ADDRESS), deploy, serve until SIGTERM / SIGINT."""
    from app.runtime.lineup import load_trained
    from app.checkpoint import CheckpointError
    for path in spec.checkpoints:       # here first: a replica's failure would be Ray's traceback
        try:
            load_trained(path, spec.frontend.name, "cpu")
        except CheckpointError as e:
            raise SystemExit(f"serve: error: {e}") from None
    try:
        ray.init(address=address, namespace=NAMESPACE, runtime_env=runtime_env(),   # "local": a new instance
                 include_dashboard=False, log_to_driver=False, configure_logging=False)
    except Exception as e:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError, ...
        raise SystemExit(f"serve: cannot {'start Ray' if address == 'local' else f'reach the Ray cluster at {address!r}'}: "
                         f"{type(e).__name__}: {first_line(e)}") from None
    from .edge import Edge, signalled
    from .server import Public, ServeError
    stop, hurry = threading.Event(), threading.Event()    # set by signals once the edge serves
    try:
        try:
            url = start(spec, token, host, port, replicas, public=public)
        except ServeError as e:
            raise SystemExit(f"serve: {e}") from None
        except RuntimeError as e:       # Ray Serve's "Deploying application ... failed"
            raise SystemExit(f"serve: Ray Serve could not deploy the app ({first_line(e)}); "
                             f"the replicas' errors are in Ray's logs") from None
        print(f"# serving {(public or Public()).urls(url.split('/')[2])} on Ray Serve: {replicas} replicas of up to {spec.capacity} streams each"
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
