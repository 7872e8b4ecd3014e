"""The public socket of `serve --workers K` and `serve --ray`: the edge, relaying each client's
WebSocket message by message to one of several engine servers (worker processes, Ray Serve
replicas), each serving the plain app on a loopback port of its own, and answering
``/v1/health`` with their sum.

The edge is the one socket that faces clients. It checks the client's token (constant time),
enforces the request deadline and the per-address caps (app/serve/guard.py; its upstreams see
only the edge's address), and connects to an upstream with the upstreams' own token, a secret
of this process that no client sees. A new stream goes to the upstream holding the fewest of the
edge's streams; one that refuses the connection (gone, not yet replaced) is passed over.

Why a relay: when an upstream dies, its connections drop without a close frame (1006, no
reason). The edge sees that and closes the client's connection itself with 1012 and a reason
(its stream is gone; connect again for a fresh one). Every other close, its code and reason,
passes through unchanged, as do the messages both ways. Backpressure passes through too: the
edge reads a client only as fast as the upstream takes its messages, and an upstream only as
fast as the client takes its records.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

from fastapi import FastAPI, Request, Response, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from .guard import AddressStreams
from .protocol import GOING_AWAY, SERVER_ERROR, Limits, health_sums, try_later
from .upload import hop_batches, reason_of, refused
from .server import DRAIN_SECONDS, LoopServer, package_version, uvicorn_config
from .access import Access, AccessGuard, answer_subprotocol, token_ok

UPSTREAM_GONE = 1012                # RFC 6455 "service restart": the client may connect again
SHUTTING_DOWN = "the server is shutting down"
CLOSE_SECONDS = 2.0
OPEN_SECONDS = 30.0


class Fixed:
    """Upstreams at fixed addresses (``addresses()``: where new streams may go, read at each
    new stream; ``noun``: what they are, in health and in reasons)."""

    def __init__(self, addresses: list[str], noun: str = "servers"):
        self.fixed, self.noun = list(addresses), noun

    def addresses(self) -> list[str]:
        return list(self.fixed)


def build_edge(upstreams, limits: Limits, streams: int, token: str | None, upstream_token: str | None,
               origins=(), loopback: bool = True) -> FastAPI:
    """The relay app: clients with ``token`` (None: any), at most ``streams`` in all and the
    per-address caps of ``limits``, relayed to ``upstreams`` (``Fixed``, or an object with the
    same two members) with ``upstream_token``; the page and the access rules as the server's
    (``origins``, ``loopback``: app/serve/access.py)."""
    from audio.sources import FileSource

    from .page import add_page
    from .service import API_TEXT, UPLOAD_DOC
    from .upload import busy, opened, spool, unauthorized
    app = add_page(FastAPI(version=package_version() or "0", **API_TEXT))
    app.add_middleware(AccessGuard, access=Access(token, frozenset(origins), loopback))
    app.state.upstreams = upstreams
    app.state.relays, app.state.closing = {}, False          # (client, upstream) -> the client-to-upstream task
    app.state.load = {}                                      # an upstream's address -> the streams relayed to it
    places = AddressStreams(limits)
    one = upstreams.noun[:-1]
    headers = {"Authorization": f"Bearer {upstream_token}"} if upstream_token else {}

    @app.get("/v1/health")
    async def health():
        """The upstreams' health summed (each answers its own), with the edge's limits."""
        answers = await asyncio.gather(*(http_get(a, "/v1/health") for a in upstreams.addresses()))
        healths = [json.loads(body) for status, body in answers if status == 200]
        if not healths:
            return Response(json.dumps({"error": f"no {one} is running"}).encode(), status_code=503,
                            media_type="application/json")
        return {**summed(healths, upstreams.noun), "limits": limits.doc(), "token_required": token is not None}

    @app.post("/v1/classify", summary="Classify a whole audio file: its verdict, as classify --jsonl's last record",
              openapi_extra=UPLOAD_DOC)
    async def classify(request: Request, records: bool = False):
        """The file decoded here (as the plain server does it) and streamed to an upstream as a
        client that keeps to its credit; its records and verdict answer the request."""
        if not token_ok(request.headers, token):
            return unauthorized()
        with places.held(request, streams) as refusal:
            if refusal is not None:
                return busy(refusal.reason, limits.retry_seconds)
            spooled = await spool(request, limits.upload_bytes, limits.request_seconds)
            if not isinstance(spooled, str):
                return spooled
            try:
                source = await opened(spooled)
                if not isinstance(source, FileSource):
                    return source
                for address in sorted(upstreams.addresses(), key=lambda a: app.state.load.get(a, 0)):
                    app.state.load[address] = app.state.load.get(address, 0) + 1
                    try:
                        return await upload_through(address, headers, source, spooled, records)
                    except (InvalidStatus, OSError, asyncio.TimeoutError):
                        continue                 # (one stopping, or gone and not yet replaced): the next one
                    finally:
                        unload(app, address)
                return busy(f"no {one} took the file; retry in {limits.retry_seconds:g} s", limits.retry_seconds)
            finally:
                os.unlink(spooled)

    @app.websocket("/v1/stream")
    async def stream(ws: WebSocket):
        if not token_ok(ws.headers, token):
            await ws.close(code=1008)                    # before accepting: the upgrade answers 403
            return
        subprotocol = answer_subprotocol(ws.headers)
        if app.state.closing:                            # draining: no new streams
            await ws.accept(subprotocol=subprotocol)
            await close(ws, GOING_AWAY, SHUTTING_DOWN)
            return
        with places.held(ws, streams) as refusal:
            if refusal is not None:
                await ws.accept(subprotocol=subprotocol)
                await close(ws, refusal.code, refusal.reason)
                return
            failure = f"no {one} is running"
            for address in sorted(upstreams.addresses(), key=lambda a: app.state.load.get(a, 0)):
                app.state.load[address] = app.state.load.get(address, 0) + 1
                try:
                    upstream = await connect(f"ws://{address}/v1/stream", additional_headers=headers, max_size=None,
                                             open_timeout=OPEN_SECONDS, ping_interval=None, proxy=None,
                                             compression=None)      # loopback: no deflate of every hop
                except (InvalidStatus, OSError, asyncio.TimeoutError) as e:
                    unload(app, address)         # (one stopping, or gone and not yet replaced): the next one
                    failure = f"HTTP {e.response.status_code}" if isinstance(e, InvalidStatus) else type(e).__name__
                    continue
                except BaseException:
                    unload(app, address)
                    raise
                try:
                    await ws.accept(subprotocol=subprotocol)
                    await relay(ws, upstream, f"the {one} serving this stream stopped; connect again for a fresh stream")
                finally:
                    unload(app, address)
                return
            await ws.accept(subprotocol=subprotocol)
            await close(ws, *astuple(try_later(f"no {one} took the stream ({failure})", limits)))

    return app


async def upload_through(address: str, headers: dict, source, path: str, records: bool) -> JSONResponse:
    """A decoded file streamed to the upstream at ``address`` as 16 kHz f32le, within the credit
    its hello answer gives: the verdict record (the file's decoding counts in it), with
    ``records`` its hop records too. OSError / InvalidStatus when the upstream cannot be reached
    (the caller tries another); a stream cut short answers 502."""
    from audio.errors import AudioError
    from audio.melspec import HOP, SAMPLE_RATE
    upstream = await connect(f"ws://{address}/v1/stream", additional_headers=headers, max_size=None,
                             open_timeout=OPEN_SECONDS, ping_interval=None, proxy=None, compression=None)
    kept, error, verdict = [], None, None
    try:
        await upstream.send(json.dumps({"sample_rate": SAMPLE_RATE, "channels": 1, "format": "f32le"}))
        credit = json.loads(await upstream.recv())["credit_seconds"]
        heard, sent = 0.0, 0.0

        async def take() -> None:
            """One message of the upstream: a record (its audio time is heard) or the verdict."""
            nonlocal heard, verdict
            d = json.loads(await upstream.recv())
            if "verdict" in d:
                verdict = d
                return
            heard = d["audio_time"]
            if records:
                kept.append(d)
        try:
            batches = hop_batches(source)
            while batch := await asyncio.to_thread(next, batches, None):
                for hop in batch:
                    while sent - heard >= credit:
                        await take()
                    await upstream.send(hop.astype("<f4").tobytes())
                    sent += HOP / SAMPLE_RATE
        except AudioError as e:               # corrupt past its start: the verdict says so, as classify's
            error = reason_of(e, path)
        await upstream.send(json.dumps({"end": True}))
        while verdict is None:
            await take()
    except ConnectionClosed:
        frame = upstream.protocol.close_rcvd
        return refused(502, f"the stream was cut: {frame.reason if frame else 'the upstream stopped'}")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(upstream.close(), CLOSE_SECONDS)
    verdict.update(nonfinite_zeroed=source.stats.nonfinite, clipped=source.stats.clipped,
                   error=verdict["error"] or error)
    return JSONResponse({"records": kept, **verdict} if records else verdict)


def astuple(e) -> tuple[int, str]:
    return e.code, e.reason


def summed(healths: list[dict], noun: str) -> dict:
    """Several servers' health as one: counts summed, ``NOUN`` (how many answered) and
    ``streams_by_NOUN`` (each one's streams, busiest first) in place of the lanes."""
    sums, split = health_sums(healths)
    total = {k: v for k, v in healths[0].items() if k != "streams_by_lane"}
    total.update(sums, draining=any(h["draining"] for h in healths), **{noun: len(healths)},
                 **{f"streams_by_{noun[:-1]}": split})
    return total


def unload(app: FastAPI, address: str) -> None:
    app.state.load[address] -= 1
    if not app.state.load[address]:
        del app.state.load[address]


async def relay(ws: WebSocket, upstream, gone: str) -> None:
    """Both directions until either side ends; then the other side's close (``gone``: the reason
    when the upstream vanished), and the upstream's connection closed whatever happened (its
    stream leaves that engine)."""
    up = asyncio.create_task(client_to_upstream(ws, upstream))
    down = asyncio.create_task(upstream_to_client(ws, upstream))
    relays, pair = ws.app.state.relays, (ws, upstream)
    relays[pair] = up
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        if up in done and up.cancelled():   # draining: the upstream finishes the stream (``drain``)
            done, _ = await asyncio.wait({down})
        if down in done:                    # the upstream closed (or vanished), or the client took no more
            up.cancel()
            code, reason = (GOING_AWAY, SHUTTING_DOWN) if ws.app.state.closing else closed_by(upstream, down, gone)
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
    stops taking its client's audio, its upstream is told the stream has ended, and the client
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
    """The server is stopping: every client closed 1001, every upstream connection closed."""
    app.state.closing = True

    async def one(ws, upstream):
        await close(ws, GOING_AWAY, SHUTTING_DOWN)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(upstream.close(), CLOSE_SECONDS)
    await asyncio.gather(*(one(ws, up) for ws, up in list(app.state.relays)))


async def client_to_upstream(ws: WebSocket, upstream) -> None:
    with contextlib.suppress(WebSocketDisconnect, ConnectionClosed):
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes") if message.get("bytes") is not None else message.get("text")
            if data is None:
                return
            await upstream.send(data)


async def upstream_to_client(ws: WebSocket, upstream) -> None:
    async for message in upstream:          # ends when the upstream's side is closed
        if isinstance(message, bytes):
            await ws.send_bytes(message)
        else:
            await ws.send_text(message)


def closed_by(upstream, down: asyncio.Task, gone: str) -> tuple[int, str]:
    """The code and reason to give the client for the upstream's end."""
    if not down.cancelled() and down.exception() is not None and not isinstance(down.exception(), ConnectionClosed):
        return SERVER_ERROR, f"relay error: {type(down.exception()).__name__}"
    frame = upstream.protocol.close_rcvd
    if frame is None:                       # no close frame: the upstream vanished
        return UPSTREAM_GONE, gone
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
        return 503, json.dumps({"error": f"the health cannot be read: {type(e).__name__}"}).encode()


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

    def __init__(self, upstreams, sock, limits: Limits, streams: int, token: str | None, upstream_token: str | None,
                 public):
        self.app = build_edge(upstreams, limits, streams, token, upstream_token, public.origins, public.loopback)
        self.upstreams = upstreams
        # each relayed stream holds two descriptors (the client's, the upstream's)
        config = uvicorn_config(self.app, limits, 2 * streams, lifespan="off", timeout_graceful_shutdown=2,
                                **public.tls())
        self.server = LoopServer(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name="nystream-edge")

    @classmethod
    def start(cls, upstreams, sock, limits: Limits, streams: int, token: str | None = None,
              upstream_token: str | None = None, public=None) -> None:
        """The edge on ``sock`` (``build_edge``), offered as ``public`` says (app/serve/server.py
        ``Public``; None: loopback, no TLS)."""
        from .server import Public
        cls.stop()
        edge = cls.running = cls(upstreams, sock, limits, streams, token, upstream_token, public or Public())
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
