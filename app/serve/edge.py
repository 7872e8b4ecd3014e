"""`serve --ray`'s front door: the public socket, in the driver's process, relaying each client's
WebSocket message by message to a replica (its own port, under Ray Serve's direct ingress) or to
Ray Serve's proxy (a loopback port of its own), and answering ``/v1/health`` from them.

Why a relay: when a replica dies, its connections drop without a close frame (1006, no reason).
The edge sees that and closes the client's connection itself with 1012 and a reason (its stream
is gone; connect again for a fresh one). Every other close, its code and reason, passes through
unchanged, as do the messages both ways; a refused upgrade (a missing or wrong token) is refused
here the same way. Backpressure passes through too: the edge reads a client only as fast as the
replica takes its messages, and a replica only as fast as the client takes its records.

Given the replicas' own addresses, the edge picks a new stream's replica itself: the one holding
the fewest of its streams, passing over one that refuses the connection (gone, not yet
replaced). Given a proxy, it opens its connections one at a time (each until its upgrade is
answered, at most ROUTE_SECONDS): Ray Serve's router picks a connection's replica by the
replicas' ongoing requests, and connections routed at the same moment see the same counts. 32
clients joining within a hop were split 24 + 8 over 2 replicas (the busier one then fell
seconds behind while the other idled) and 16 + 16 one at a time (`bench --serve 32 --ray 2`, its
health's split, one run each, 2026-11-27; neither stored).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import uvicorn
from fastapi import FastAPI, Response, WebSocket, WebSocketDisconnect
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from .protocol import GOING_AWAY, SERVER_ERROR, TRY_LATER, health_sums
from .server import DRAIN_SECONDS, LoopServer

REPLICA_GONE = 1012                 # RFC 6455 "service restart": the client may connect again
REPLICA_GONE_REASON = "the replica serving this stream stopped; connect again for a fresh stream"
SHUTTING_DOWN = "the server is shutting down"
CLOSE_SECONDS = 2.0
OPEN_SECONDS = 30.0
ROUTE_SECONDS = 2.0                 # the longest one connection's routing holds up the next one's


def build_edge(upstreams) -> FastAPI:
    """The relay app in front of Ray Serve (``upstreams``: see ``as_upstreams``)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.upstreams = as_upstreams(upstreams)
    app.state.relays, app.state.closing = {}, False          # (client, replica) -> the client-to-replica task
    app.state.load = {}                                      # a replica's address -> the streams relayed to it
    app.state.routing = asyncio.Lock()                       # one connection to the proxy opening at a time

    @app.get("/v1/health")
    async def health():
        """The replicas' sum (any of them answers it), and how the edge reaches them: ``ingress``
        "direct" (each replica's own port) or "proxy" (Ray Serve's)."""
        addresses, direct = app.state.upstreams()
        status, body = 503, json.dumps({"error": "no replica is running"}).encode()
        if getattr(app.state.upstreams, "sums", False):     # workers: each answers its own
            answers = await asyncio.gather(*(http_get(a, "/v1/health") for a in addresses))
            healths = [json.loads(b) for st, b in answers if st == 200]
            if healths:
                return Response(json.dumps(summed(healths)).encode(), media_type="application/json")
            return Response(body, status_code=status, media_type="application/json")
        for address in addresses:                            # the first that answers: replicas answer the sum
            status, body = await http_get(address, "/v1/health")
            if status < 500:
                break
        with contextlib.suppress(ValueError, TypeError):
            body = json.dumps({**json.loads(body), "ingress": "direct" if direct else "proxy"}).encode()
        return Response(body, status_code=status, media_type="application/json")

    @app.websocket("/v1/stream")
    async def stream(ws: WebSocket):
        if app.state.closing:                            # draining: no new streams
            await ws.accept()
            await close(ws, GOING_AWAY, SHUTTING_DOWN)
            return
        headers = {"Authorization": ws.headers["authorization"]} if "authorization" in ws.headers else {}
        addresses, direct = app.state.upstreams()
        if direct:                                       # the replica with the fewest of this edge's streams first
            addresses = sorted(addresses, key=lambda a: app.state.load.get(a, 0))
        failure = "no replica is running"
        for address in addresses:
            app.state.load[address] = app.state.load.get(address, 0) + 1
            try:
                opening = connect(f"ws://{address}/v1/stream", additional_headers=headers, max_size=None,
                                  open_timeout=OPEN_SECONDS, ping_interval=None, proxy=None,
                                  compression=None)      # loopback: no deflate of every hop
                upstream = await (opening if direct else routed(app.state.routing, opening))
            except InvalidStatus as e:
                unload(app, address)
                if e.response.status_code in (401, 403):  # the replica refused the token: so does the edge
                    await ws.close(code=1008)
                    return
                failure = f"HTTP {e.response.status_code}"
                continue                                 # (a replica stopping): the next one
            except (OSError, asyncio.TimeoutError) as e:
                unload(app, address)
                failure = type(e).__name__
                continue                                 # (a replica gone, not yet replaced): the next one
            except BaseException:
                unload(app, address)
                raise
            try:
                await ws.accept()
                await relay(ws, upstream)
            finally:
                unload(app, address)
            return
        await ws.accept()
        await close(ws, TRY_LATER, f"no replica took the stream ({failure}); try again")

    return app


def as_upstreams(upstreams):
    """Where new streams go: a callable giving (addresses "HOST:PORT", direct), read at each new
    stream; direct: each address is a replica's own (the edge spreads the streams over them),
    else Ray Serve's proxies (its router picks the replica). A plain "HOST:PORT" is one proxy."""
    if isinstance(upstreams, str):
        return lambda: ([upstreams], False)
    return upstreams


def summed(healths: list[dict]) -> dict:
    """The workers' health as one server's: counts summed, ``workers`` and ``streams_by_worker``
    (busiest first) in place of the lanes."""
    sums, split = health_sums(healths)
    total = {k: v for k, v in healths[0].items() if k != "streams_by_lane"}
    total.update(sums, draining=any(h["draining"] for h in healths), workers=len(healths), streams_by_worker=split)
    return total


def unload(app: FastAPI, address: str) -> None:
    app.state.load[address] -= 1
    if not app.state.load[address]:
        del app.state.load[address]


async def routed(routing: asyncio.Lock, opening):
    """Await the connection ``opening`` (a coroutine), the others' waiting until it is open or
    ROUTE_SECONDS have passed: so that the router counts it before it routes the next one."""
    async with routing:
        task = asyncio.ensure_future(opening)
        try:
            await asyncio.wait({task}, timeout=ROUTE_SECONDS)
        except asyncio.CancelledError:      # the client went away meanwhile: so does its connection
            task.cancel()
            raise
    return await task


async def relay(ws: WebSocket, upstream) -> None:
    """Both directions until either side ends; then the other side's close, and the replica's
    connection closed whatever happened (its stream leaves the replica's engine)."""
    up = asyncio.create_task(client_to_replica(ws, upstream))
    down = asyncio.create_task(replica_to_client(ws, upstream))
    relays, pair = ws.app.state.relays, (ws, upstream)
    relays[pair] = up
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        if up in done and up.cancelled():   # draining: the replica finishes the stream (``drain``)
            done, _ = await asyncio.wait({down})
        if down in done:                    # the replica closed (or vanished), or the client took no more
            up.cancel()
            code, reason = (GOING_AWAY, SHUTTING_DOWN) if ws.app.state.closing else closed_by(upstream, down)
            await close(ws, code, reason)
        else:                               # the client went away: so does its stream
            down.cancel()
            up.exception()                  # read, so that it is not reported as never retrieved
    finally:
        relays.pop(pair, None)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(upstream.close(), CLOSE_SECONDS)


async def drain(app: FastAPI, seconds: float) -> None:
    """The server is stopping, as a plain server's drain: no new streams; each relayed stream
    stops taking its client's audio, its replica is told the stream has ended, and the client
    gets the records of the audio relayed so far, its verdict and a close 1001. Streams still
    open after ``seconds`` are closed 1001 as they are (``close_all``)."""
    app.state.closing = True

    async def end(pair, up: asyncio.Task):
        up.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await up
        with contextlib.suppress(Exception):
            await pair[1].send(json.dumps({"end": True}))
    await asyncio.gather(*(end(pair, up) for pair, up in list(app.state.relays.items())))
    deadline = asyncio.get_running_loop().time() + seconds
    while app.state.relays and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await close_all(app)


async def close_all(app: FastAPI) -> None:
    """The server is stopping: every client closed 1001, every replica connection closed."""
    app.state.closing = True

    async def one(ws, upstream):
        await close(ws, GOING_AWAY, SHUTTING_DOWN)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(upstream.close(), CLOSE_SECONDS)
    await asyncio.gather(*(one(ws, up) for ws, up in list(app.state.relays)))


async def client_to_replica(ws: WebSocket, upstream) -> None:
    with contextlib.suppress(WebSocketDisconnect, ConnectionClosed):
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes") if message.get("bytes") is not None else message.get("text")
            if data is None:
                return
            await upstream.send(data)


async def replica_to_client(ws: WebSocket, upstream) -> None:
    async for message in upstream:          # ends when the replica's side is closed
        if isinstance(message, bytes):
            await ws.send_bytes(message)
        else:
            await ws.send_text(message)


def closed_by(upstream, down: asyncio.Task) -> tuple[int, str]:
    """The code and reason to give the client for the replica's end."""
    if not down.cancelled() and down.exception() is not None and not isinstance(down.exception(), ConnectionClosed):
        return SERVER_ERROR, f"relay error: {type(down.exception()).__name__}"
    frame = upstream.protocol.close_rcvd
    if frame is None:                       # no close frame: the replica (or its proxy) vanished
        return REPLICA_GONE, REPLICA_GONE_REASON
    return frame.code, frame.reason


async def close(ws: WebSocket, code: int, reason: str) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(code=code, reason=reason), CLOSE_SECONDS)


async def http_get(address: str, path: str) -> tuple[int, bytes]:
    """(status, body) of GET ``path`` at ``address``; 503 with a JSON error when it cannot be read."""
    def get():
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))     # loopback: no proxy
        try:
            with direct.open(f"http://{address}{path}", timeout=OPEN_SECONDS) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
    try:
        return await asyncio.to_thread(get)
    except OSError as e:
        return 503, json.dumps({"error": f"the replicas' health cannot be read: {type(e).__name__}"}).encode()


def signalled() -> tuple[threading.Event, threading.Event]:
    """SIGTERM / SIGINT handlers for a process whose server is the edge: the first sets ``stop``
    (drain), a second ``hurry`` (stop at once); ``Edge.finish`` takes both."""
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(sig, frame):
        (hurry if stop.is_set() else stop).set()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop, hurry


class Edge:
    """The edge's uvicorn server on a thread of this process (one per process)."""
    running: "Edge | None" = None

    def __init__(self, upstreams, sock, message_bytes: int):
        self.app, self.upstreams = build_edge(upstreams), upstreams
        config = uvicorn.Config(self.app, ws_max_size=message_bytes, ws_ping_interval=20.0, ws_ping_timeout=20.0,
                                ws_per_message_deflate=False, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = LoopServer(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="nystream-edge")

    @classmethod
    def start(cls, upstreams, sock, message_bytes: int) -> None:
        """The edge on ``sock``, relaying to ``upstreams`` (``as_upstreams``)."""
        cls.stop()
        edge = cls.running = cls(upstreams, sock, message_bytes)
        edge.thread.start()
        deadline = time.monotonic() + 10
        while not edge.server.started and edge.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not edge.server.started:
            cls.stop()
            raise RuntimeError("the edge's server did not start within 10 s")

    @classmethod
    def finish(cls, stop: threading.Event, hurry: threading.Event) -> None:
        """The end of a `serve` process: its streams drained if a signal came (``signalled``;
        at most DRAIN_SECONDS), else closed 1001 at once; then the edge stopped."""
        if stop.is_set() and cls.running is not None:
            print(f"# draining {len(cls.running.app.state.relays)} streams", file=sys.stderr, flush=True)
        cls.stop(drain_seconds=DRAIN_SECONDS if stop.is_set() else 0.0, hurry=hurry)

    @classmethod
    def stop(cls, drain_seconds: float = 0.0, hurry: threading.Event | None = None) -> None:
        """Every relayed stream drained (``drain``, at most ``drain_seconds``; cut short when
        ``hurry`` is set) or, with no time to drain, closed 1001 at once; then the server."""
        edge, cls.running = cls.running, None
        if edge is None:
            return
        edge.app.state.closing = True
        loop = getattr(edge.server, "loop", None)
        if edge.server.started and loop is not None:
            job = drain(edge.app, drain_seconds) if drain_seconds > 0 else close_all(edge.app)
            done = asyncio.run_coroutine_threadsafe(job, loop)
            deadline = time.monotonic() + drain_seconds + 10
            while not done.done() and time.monotonic() < deadline and not (hurry and hurry.is_set()):
                time.sleep(0.05)
            if not done.done():
                done.cancel()
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(close_all(edge.app), loop).result(timeout=10)
        edge.server.should_exit = True
        edge.thread.join(timeout=10)
        if hasattr(edge.upstreams, "close"):             # its refreshing thread
            edge.upstreams.close()
