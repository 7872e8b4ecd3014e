"""The page `serve` answers at ``/`` (app/serve/static/: plain HTML, CSS and JavaScript, no build
step, nothing fetched from another site) and ``/docs``, the HTTP API read from ``/openapi.json``.

The page streams the microphone to ``/v1/stream`` (an AudioWorklet posts 2,048-frame blocks of
mono float32 at the audio context's rate; they are sent as f32le within the server's credit),
draws each record (a model's genre probabilities as bars, the top genre's timeline, the step's
FLOPs and latency), shows the verdict when stopped and the server's refusals as text; a file
chosen or dropped on it is posted to ``/v1/classify``. A token comes from the URL's fragment
(``/#token=...``: browsers never send a fragment, so it reaches no log) or a prompt, and is
kept for the tab only.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")
# the page's own files only; no inline script; not framed by another site; no referrer
HEADERS = {"content-security-policy": "default-src 'self'; connect-src 'self'; img-src 'self' data:; "
                                      "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
           "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-cache"}


def add_page(app: FastAPI) -> FastAPI:
    """``app`` with the page at ``/``, the API's description at ``/docs`` and their files."""

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", headers=HEADERS)

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return FileResponse(STATIC / "docs.html", headers=HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
