"""``POST /v1/classify``: a whole file in, its verdict out (the record `classify --jsonl` ends a
file with; its hop records too with ``?records=1``).

The body is copied to a temporary file as it arrives (formats need to seek; nothing is held in
memory) and refused 413 once it passes the cap, or before a byte is read when its
``Content-Length`` says it would. The file is checked and decoded as `classify` does it (the same
reader, the same hostile-file guards), on a thread, and its hops join the hub as one more stream:
every lane hop steps each of its streams that has a hop, so a file shares the engine with the
live streams and never holds their hops back; it is fed at most the outbox's worth of hops ahead
of its records. The temporary file is removed when the answer is made, whatever happened.
"""
from __future__ import annotations

import asyncio
import json
import os
import tempfile

from fastapi import Request
from fastapi.responses import JSONResponse

from .hub import FINISHED, Hub
from .protocol import Hello, ProtocolError, first_line

HOPS_A_READ = 8                 # hops decoded per thread call (2 s of audio)
UNSUPPORTED = ("cannot decode", "has no audio track")       # 415; every other refusal of the file is 422


def refused(status: int, reason: str, **headers) -> JSONResponse:
    """A one-line JSON refusal."""
    return JSONResponse({"error": reason}, status_code=status, headers=headers or None)


def unauthorized() -> JSONResponse:
    return refused(401, "this server needs its token: Authorization: Bearer TOKEN", **{"www-authenticate": "Bearer"})


def busy(reason: str, retry_seconds: float) -> JSONResponse:
    """503: full or draining, with when to ask again."""
    return refused(503, reason, **{"retry-after": f"{retry_seconds:g}"})


async def spool(request: Request, cap: int, seconds: float) -> str | JSONResponse:
    """The body in a temporary file (its path), or the refusal: 413 over ``cap`` bytes (by its
    Content-Length, before reading; else once the bytes read pass it), 408 when no part of it
    arrives for ``seconds``, 400 for an empty body, 507 when the disk is full."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > cap):
        return too_big(cap)
    fd, path = tempfile.mkstemp(prefix="nystream-upload-")
    total, parts = 0, request.stream().__aiter__()
    try:
        with os.fdopen(fd, "wb") as f:
            while True:
                try:
                    chunk = await asyncio.wait_for(parts.__anext__(), seconds)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    os.unlink(path)
                    return refused(408, f"no part of the body arrived for {seconds:g} s", connection="close")
                total += len(chunk)
                if total > cap:
                    os.unlink(path)
                    return too_big(cap)
                f.write(chunk)
    except OSError as e:
        os.unlink(path)
        return refused(507, f"the server cannot store the upload: {e.strerror or e}")
    except BaseException:                  # the client went away mid-body (or the request was cancelled)
        os.unlink(path)
        raise
    if total == 0:
        os.unlink(path)
        return refused(400, "the body is empty: send the audio file's bytes")
    return path


def too_big(cap: int) -> JSONResponse:
    return refused(413, f"the body is over {cap / 2**20:g} MiB, the most this server takes (serve --max-upload-mb)",
                   connection="close")


async def classify_upload(request: Request, hub: Hub, records: bool, cap: int) -> JSONResponse:
    """The answer to one POST: the verdict record (with ``records``: its hop records first)."""
    spooled = await spool(request, cap, hub.limits.request_seconds)
    if isinstance(spooled, JSONResponse):
        return spooled
    try:
        return await classify_file(request, spooled, hub, records)
    finally:
        os.unlink(spooled)


async def opened(path: str):
    """The spooled file as a FileSource (checked as `classify` checks a file), or its refusal:
    415 for what is not audio in a format read here, 422 for audio that cannot be used."""
    from audio.errors import AudioError
    from audio.sources import FileSource
    try:
        return await asyncio.to_thread(FileSource, path)
    except AudioError as e:
        reason = reason_of(e, path)
        return refused(415 if any(u in reason for u in UNSUPPORTED) else 422, reason)


def reason_of(e: BaseException, path: str) -> str:
    """An error's first line, naming the upload, not the server's temporary file."""
    return first_line(e).replace(path, "the upload")


def hop_batches(source):
    """The file's hops, HOPS_A_READ at a time (decoded on a thread: ``await asyncio.to_thread(next, it)``)."""
    hops = source.signal_hops(source.stats)
    while batch := [h for _, h in zip(range(HOPS_A_READ), hops)]:
        yield batch


async def classify_file(request: Request, path: str, hub: Hub, records: bool) -> JSONResponse:
    from audio.errors import AudioError
    from audio.melspec import SAMPLE_RATE
    source = await opened(path)
    if isinstance(source, JSONResponse):
        return source
    try:
        conn = await hub.open(Hello(SAMPLE_RATE, 1, "f32le"), kind="upload")   # fed 16 kHz hops, not PCM
    except ProtocolError as e:                        # full, or draining
        return busy(e.reason, hub.limits.retry_seconds)
    conn.source.stats = source.stats                  # the file's decoding counts (clipped, repaired samples)
    conn.source.input_rate = source.input_rate
    kept: list[dict] = []

    async def read() -> None:
        while (text := await conn.outbox.get()) is not FINISHED:
            if records:
                kept.append(json.loads(text))

    reader = asyncio.create_task(read())
    error = None
    try:
        batches = hop_batches(source)
        while not conn.failure.done() and (batch := await asyncio.to_thread(next, batches, None)):
            for hop in batch:
                conn.source.push(hop)
            hub.poke(conn)
            if await request.is_disconnected():       # nobody to answer: the stream leaves
                hub.gone(conn)
                reader.cancel()
                return refused(499, "the client went away")
            while len(conn.source.ready) > conn.outbox_limit // 2 and not conn.failure.done():
                await asyncio.sleep(0.02)
    except AudioError as e:                            # corrupt past its start: the verdict says so, as classify's
        error = reason_of(e, path)
    except BaseException:
        hub.gone(conn)
        reader.cancel()
        raise
    hub.end(conn)
    await asyncio.wait({reader, conn.failure}, return_when=asyncio.FIRST_COMPLETED)
    if conn.failure.done() and not reader.done():
        hub.gone(conn)
        reader.cancel()
        code, reason = conn.failure.result()
        return refused(500, reason)
    message = conn.verdict()
    message["error"] = message["error"] or error
    if records:
        message = {"records": kept, **message}
    return JSONResponse(message)
