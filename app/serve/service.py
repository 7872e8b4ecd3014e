"""The ASGI application of `serve` (FastAPI on Starlette): the page at ``/`` (app/serve/page.py),
``GET /v1/health``, ``POST /v1/classify`` (a whole file, app/serve/upload.py) and the WebSocket
``/v1/stream``, one stream of the hub's batched engine per connection (protocol v1,
docs/serve.md), behind the access rules (app/serve/access.py), run by uvicorn
(app/serve/server.py).

The hub is made by ``make_hub()`` when the app starts (its lifespan), in the process that serves
(a worker, a Ray Serve replica: each builds its own engine).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect

from .access import Access, AccessGuard, answer_subprotocol, token_ok
from .guard import AddressStreams
from .hub import FINISHED, Connection, Hub, hello_reply
from .protocol import (INVALID, POLICY, SERVER_ERROR, UNSUPPORTED, VERSION, Limits, ProtocolError, parse_control,
                       parse_hello)


def build_app(make_hub, *, token: str | None = None, limits: Limits = Limits(), version: str = "",
              on_start=None, origins=(), loopback: bool = True) -> FastAPI:
    """The app; ``make_hub()`` -> Hub, called once at start-up, then ``on_start(hub)``.
    ``origins``: the pages' origins allowed beside the server's own; ``loopback``: the server
    listens on loopback only (it then answers requests to a loopback name only)."""
    from .page import add_page
    from .upload import busy, classify_upload, unauthorized

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.hub = hub = make_hub()
        if on_start is not None:
            on_start(hub)
        loop = asyncio.create_task(hub.run())
        try:
            yield
        finally:
            loop.cancel()
            for pool in hub.pools:
                pool.shutdown(wait=False, cancel_futures=True)

    app = add_page(FastAPI(lifespan=lifespan, version=version or "0", **API_TEXT))
    app.add_middleware(AccessGuard, access=Access(token, frozenset(origins), loopback))
    app.state.token, app.state.limits = token, limits
    streams = AddressStreams(limits)

    @app.get("/v1/health", summary="The server's load, models and limits (no token needed)")
    async def health():
        return {**app.state.hub.health(), "protocol": VERSION, "version": version, "limits": limits.doc(),
                "token_required": token is not None}

    @app.post("/v1/classify", summary="Classify a whole audio file: its verdict, as classify --jsonl's last record",
              openapi_extra=UPLOAD_DOC)
    async def classify(request: Request, records: bool = False):
        """The body is the file's bytes, in any format `classify` reads; ``records=1`` adds the
        hop records (``records``, before the verdict's keys)."""
        if not token_ok(request.headers, token):
            return unauthorized()
        with streams.held(request, app.state.hub.capacity) as refusal:
            if refusal is not None:
                return busy(refusal.reason, limits.retry_seconds)
            return await classify_upload(request, app.state.hub, records, limits.upload_bytes)

    @app.websocket("/v1/stream")
    async def stream(ws: WebSocket):
        if not token_ok(ws.headers, token):
            await ws.close(code=1008)                  # before accepting: the upgrade answers 403
            return
        with streams.held(ws, app.state.hub.capacity) as refusal:
            await ws.accept(subprotocol=answer_subprotocol(ws.headers))
            if refusal is not None:
                await close(ws, refusal.code, refusal.reason)
                return
            await serve_connection(ws, app.state.hub, limits)

    return app


API_TEXT = {
    "title": "Nystream serve",
    "description": "Live music-genre classification. Besides these HTTP routes: the WebSocket "
                   "`/v1/stream` (protocol version 1: a JSON hello, then PCM audio, answered by one "
                   "record per 0.25 s hop and a verdict; docs/serve.md, \"Protocol, version 1\"). "
                   "The page at `/` uses both. Programs send `Authorization: Bearer TOKEN` when the "
                   "server has a token; a page offers the WebSocket subprotocols `nystream` and "
                   "`nystream.bearer.` + the token in base64url.",
    "docs_url": None, "redoc_url": None, "openapi_url": "/openapi.json",
}
UPLOAD_DOC = {
    "requestBody": {"required": True, "description": "the audio file's bytes (WAV, FLAC, MP3, OGG, Opus, AAC/M4A, "
                                                     "a video's audio track)",
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
    "responses": {
        "200": {"description": "the verdict record: verdict (per model: genre, share, confidence, steps, top), "
                               "source, hops, nonfinite_zeroed, clipped, error; with records=1 also records"},
        "400": {"description": "an empty body"}, "401": {"description": "no token, or a wrong one"},
        "403": {"description": "a page of another origin, or a host name this server does not answer"},
        "408": {"description": "no part of the body arrived for the request deadline"},
        "413": {"description": "over --max-upload-mb (by its Content-Length: refused before it is read)"},
        "415": {"description": "not audio in a format this server decodes"},
        "422": {"description": "audio that cannot be used: truncated, empty, absurd header values"},
        "503": {"description": "the server is full or draining; Retry-After says when to ask again"},
        "507": {"description": "the server's disk is full"},
    },
}


async def serve_connection(ws: WebSocket, hub: Hub, limits: Limits) -> None:
    conn = None
    try:
        try:
            message = await asyncio.wait_for(ws.receive(), limits.hello_seconds)
        except asyncio.TimeoutError:
            raise ProtocolError(INVALID, f"no hello within {limits.hello_seconds:g} s") from None
        if message["type"] == "websocket.disconnect":
            return
        hello = parse_hello(message.get("text"), limits)
        conn = await hub.open(hello)
        await ws.send_text(hello_reply(hub))
        reader = asyncio.create_task(read_audio(ws, hub, conn, limits))
        writer = asyncio.create_task(write_results(ws, conn))
        done, _ = await asyncio.wait({reader, writer, conn.failure}, return_when=asyncio.FIRST_COMPLETED)
        if conn.failure in done:
            reader.cancel()
            writer.cancel()
            code, reason = conn.failure.result()
            raise ProtocolError(code, reason)
        if reader in done and reader.exception() is not None:
            writer.cancel()
            raise reader.exception()
        if reader in done and reader.result() == "gone":
            writer.cancel()
            return
        await asyncio.wait({writer, conn.failure}, return_when=asyncio.FIRST_COMPLETED)
        reader.cancel()
        if conn.failure.done():
            raise ProtocolError(*conn.failure.result())
        writer.result()
    except ProtocolError as e:
        if conn is not None:
            hub.gone(conn)                             # its slot is free at the next hop, whatever the close does
        await close(ws, e.code, e.reason)
    except WebSocketDisconnect:
        pass
    except Exception as e:  # noqa: BLE001 - one connection's fault closes that connection only
        await close(ws, SERVER_ERROR, f"server error: {type(e).__name__}")
    finally:
        if conn is not None:
            hub.gone(conn)


async def read_audio(ws: WebSocket, hub: Hub, conn: Connection, limits: Limits) -> str:
    """Audio until {"end": true} ("ended") or a disconnect ("gone"). The server holds a client
    back (stops reading; its sends block) beyond ``limits.speed`` times real time after a first
    burst, and while more than the outbox's worth of whole hops waits for the engine. A client is
    closed (1008) when it sends nothing for ``limits.idle_seconds``, or when its audio falls more
    than ``limits.lag_seconds`` behind the time it was given (the time since its hello, less the
    time the server held it back), once ``limits.lag_grace_seconds`` have passed."""
    start = time.monotonic()
    held = 0.0                                          # seconds the server did not read this client
    while True:
        given = time.monotonic() - start - held
        late_at = max(limits.lag_grace_seconds, conn.source.decoder.seconds + limits.lag_seconds)
        if given >= late_at:
            raise ProtocolError(POLICY, f"the audio fell over {limits.lag_seconds:g} s behind real time; closed")
        wait = min(limits.idle_seconds, late_at - given)
        try:
            message = await asyncio.wait_for(ws.receive(), wait)
        except asyncio.TimeoutError:
            if wait < limits.idle_seconds:
                continue                                # the lag check above closes it
            raise ProtocolError(POLICY, f"no message for {limits.idle_seconds:g} s; closed") from None
        if message["type"] == "websocket.disconnect":
            return "gone"
        if message.get("bytes") is not None:
            hub.feed(conn, message["bytes"])
            since = time.monotonic()
            ahead = conn.source.decoder.seconds - limits.burst_seconds - limits.speed * (since - start)
            if ahead > 0:
                await asyncio.sleep(ahead / limits.speed)
            while len(conn.source.ready) > conn.outbox_limit and not conn.failure.done():
                await asyncio.sleep(0.05)
            held += time.monotonic() - since
        elif message.get("text") is not None:
            parse_control(message["text"])
            hub.end(conn)
            return "ended"
        else:
            raise ProtocolError(UNSUPPORTED, "an empty message")


async def write_results(ws: WebSocket, conn: Connection) -> None:
    """Records as the hub makes them; once the stream has left the engine (FINISHED), the
    verdict and the close (1000, or 1001 while the server drains)."""
    while (text := await conn.outbox.get()) is not FINISHED:
        await ws.send_text(text)
    await ws.send_text(json.dumps(conn.verdict()))
    await close(ws, conn.close_code, "stream ended" if conn.close_code == 1000 else "the server is shutting down")


CLOSE_SECONDS = 2.0


async def close(ws: WebSocket, code: int, reason: str) -> None:
    """Send the close frame; a client that reads nothing never lets it out: after CLOSE_SECONDS
    the app returns and the server drops the connection."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(code=code, reason=reason), CLOSE_SECONDS)
