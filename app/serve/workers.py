"""`serve --workers K` (CPU): K engine processes on loopback ports, each the plain server's app
with one lane and its share of ``--max-streams``, behind the edge (app/serve/edge.py) on the
public socket, as `serve --ray local` runs its replicas, without Ray.

Why processes: a server's lanes are threads of one Python interpreter, sharing its lock and one
allocator; at 32 clients on 2 cores two one-lane processes took no more cores and answered sooner
than one process of two lanes (docs/serve.md; which of the shared parts costs it is not
measured).

- The edge sends each new stream to the worker holding the fewest of its streams, and sums the
  workers' ``/v1/health`` (``workers``, ``streams_by_worker``).
- A worker that dies: its clients are closed 1012 with a reason by the edge, as a dead replica's;
  a new worker takes its place (a line on stderr), the others go on.
- SIGTERM or SIGINT drains at the edge (each client's records, verdict and 1001), then the
  workers stop. A worker dies with its parent, even a SIGKILLed one (Linux: PR_SET_PDEATHSIG),
  and runs in a process group of its own, so a terminal's Ctrl-C reaches the parent only.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time

from app.runtime.memory import glibc_call

from .server import DRAIN_SECONDS, Public, ServeError, bind, host_port

START_S = 300.0                      # the longest a worker may take to load its models
WATCH_S = 0.5
PR_SET_PDEATHSIG = 1                 # prctl option (linux/prctl.h)


def worker_main(spec, token: str | None, conn, threads: int) -> None:
    """One worker (a spawned process): the app with its hub on a free loopback port, which it
    sends on ``conn`` once the models are loaded."""
    os.setpgrp()
    glibc_call("prctl", PR_SET_PDEATHSIG, int(signal.SIGTERM))      # Linux; a no-op elsewhere
    import torch

    from .server import serve_app
    torch.set_num_threads(threads)
    sock = bind("127.0.0.1", 0)

    def started(hub):
        conn.send(sock.getsockname()[1])
        conn.close()
    serve_app(spec, token, sock, started, quiet=True)   # a bad option: one line; the parent says this worker stopped


class Workers:
    """The worker processes, the edge's upstreams (``edge.Fixed``'s members): each serves the app
    with its share of the streams, the limits of a server behind the edge, and ``token`` (the
    edge's secret, not the clients')."""
    noun = "workers"

    def __init__(self, spec, token: str, count: int):
        self.spec = dataclasses.replace(spec, capacity=math.ceil(spec.capacity / count), limits=spec.limits.behind_edge())
        self.token, self.threads = token, max(1, (os.cpu_count() or 1) // count)
        self.context = multiprocessing.get_context("spawn")
        self.procs: list = [None] * count
        self.places: list[str | None] = [None] * count
        self.stopping = threading.Event()
        try:
            for i, started in [(i, self._start(i)) for i in range(count)]:    # all load at once
                self._wait(i, *started)
        except BaseException:
            self.close()
            raise
        self.watch = threading.Thread(target=self._watch, daemon=True, name="nystream-workers")
        self.watch.start()

    def addresses(self) -> list[str]:
        return [a for a in self.places if a is not None]

    def _start(self, i: int):
        mine, theirs = self.context.Pipe(duplex=False)
        proc = self.context.Process(target=worker_main, args=(self.spec, self.token, theirs, self.threads),
                                    name=f"nystream-worker-{i}", daemon=True)
        proc.start()
        theirs.close()
        self.procs[i] = proc
        return proc, mine

    def _wait(self, i: int, proc, conn) -> None:
        deadline = time.monotonic() + START_S
        try:
            while not conn.poll(WATCH_S):        # (a worker that dies answers at once: EOFError)
                if self.stopping.is_set():
                    raise ServeError(f"worker {i}: the server is stopping")
                if time.monotonic() > deadline:
                    raise ServeError(f"worker {i} did not load its models within {START_S:.0f} s")
            port = conn.recv()
        except EOFError:
            proc.join(timeout=5)
            raise ServeError(f"worker {i} stopped before serving (exit code {proc.exitcode})") from None
        finally:
            conn.close()
        self.places[i] = f"127.0.0.1:{port}"

    def _watch(self) -> None:
        """A worker that exits while the server runs is replaced."""
        while not self.stopping.wait(WATCH_S):
            for i, proc in enumerate(self.procs):
                if proc is None or proc.is_alive() or self.stopping.is_set():
                    continue
                self.places[i] = None
                print(f"# worker {i} exited (code {proc.exitcode}); starting another", file=sys.stderr, flush=True)
                try:
                    self._wait(i, *self._start(i))
                except ServeError as e:
                    if self.stopping.is_set():   # close() stops what was started
                        return
                    self.procs[i].terminate()
                    self.procs[i] = None
                    print(f"# {e}; serving on with the others", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop every worker (SIGTERM: each drains what it still has, then stops)."""
        self.stopping.set()
        watch = getattr(self, "watch", None)
        if watch is not None and watch is not threading.current_thread():
            watch.join(timeout=10)
        live = [p for p in self.procs if p is not None and p.is_alive()]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + DRAIN_SECONDS + 10
        for p in live:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


def serve_workers(spec, token: str | None, host: str, port: int, count: int, public=None) -> int:
    """`serve --workers K`: the edge on ``host:port`` in front of K workers, until SIGTERM / SIGINT."""
    from .edge import Edge, signalled
    secret = secrets.token_urlsafe(32)                # the workers' token: only the edge holds it
    try:
        sock = bind(host, port)
        workers = Workers(spec, secret, count)
    except ServeError as e:
        raise SystemExit(f"serve: {e}") from None
    stop, hurry = signalled()
    try:
        Edge.start(workers, sock, spec.limits, spec.capacity, token, secret, public)
        print(f"# serving {(public or Public()).urls(host_port(host, sock.getsockname()[1]))}: {count} workers of up to "
              f"{workers.spec.capacity} streams each{', token required' if token else ''}", file=sys.stderr, flush=True)
        while not stop.is_set():
            time.sleep(0.2)
    finally:
        Edge.finish(stop, hurry)                  # the workers too (the edge's upstreams)
        workers.close()
    print("# stopped", file=sys.stderr, flush=True)
    return 0
