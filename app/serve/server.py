"""`serve` on uvicorn: loopback by default, a token required beyond it, the message-size limit
in the WebSocket layer, and SIGTERM / SIGINT draining the streams before the server stops."""
from __future__ import annotations

import asyncio
import ipaddress
import signal
import socket
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import uvicorn

from app.runtime.frontend_args import device_text

from .guard import HEAD_BYTES, Guard, GuardedHttp, PatientWebSocket
from .protocol import Limits

TOKEN_FILE_BYTES = 4096
DRAIN_SECONDS = 30.0


class ServeError(Exception):
    """A serve option that cannot work, in one line."""


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def read_token(path: str | Path) -> str:
    """The token in ``path`` (its first line, at least 16 characters of printable ASCII)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(TOKEN_FILE_BYTES + 1)
    except OSError as e:
        raise ServeError(f"cannot read the token file {p}: {e.strerror or e}") from None
    if len(data) > TOKEN_FILE_BYTES:
        raise ServeError(f"the token file {p} is over {TOKEN_FILE_BYTES} bytes")
    lines = data.decode("ascii", "replace").splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < 16 or not all(33 <= ord(c) < 127 for c in token):
        raise ServeError(f"the token in {p} must be one line of at least 16 printable ASCII characters, no spaces")
    return token


def check_exposure(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        raise ServeError(f"--host {host} is reachable from other machines: give --token-file, "
                         f"or serve on 127.0.0.1")


@dataclass(frozen=True)
class Public:
    """How the public socket is offered: the pages' origins allowed beside its own
    (``--allow-origin``), whether it listens on loopback only, and its TLS certificate and key
    (``--ssl-certfile``, ``--ssl-keyfile``: uvicorn's names)."""
    origins: tuple[str, ...] = ()
    loopback: bool = True
    certfile: str | None = None
    keyfile: str | None = None

    def tls(self) -> dict:
        """uvicorn's options for the certificate (none without one)."""
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile} if self.certfile else {}

    def stream_url(self, where: str) -> str:
        """The stream's URL at ``where`` (HOST:PORT)."""
        return f"ws{'s' if self.certfile else ''}://{where}/v1/stream"

    def urls(self, where: str) -> str:
        """The stream's and the page's URLs at ``where``, as the serving line says them."""
        return f"{self.stream_url(where)} (page: http{'s' if self.certfile else ''}://{where}/)"


def public_options(host: str, origins, certfile: str | None, keyfile: str | None) -> Public:
    """``Public`` from serve's options, each checked: ServeError in one line for an origin that is
    not scheme://host[:port], a certificate without its key (or the reverse), or a pair that does
    not load."""
    allowed = []
    for origin in origins or ():
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                or parts.query or parts.fragment or parts.username:
            raise ServeError(f"--allow-origin {origin!r}: give an origin as a browser sends it, "
                             f"scheme://host[:port] (e.g. https://example.org)")
        allowed.append(f"{parts.scheme}://{parts.netloc.lower()}")
    if bool(certfile) != bool(keyfile):
        raise ServeError("give --ssl-certfile and --ssl-keyfile together")
    if certfile:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
        except (OSError, ssl.SSLError) as e:
            raise ServeError(f"the certificate {certfile} with the key {keyfile} cannot be used: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    return Public(tuple(allowed), is_loopback(host), certfile, keyfile)


class LoopServer(uvicorn.Server):
    """A uvicorn server that keeps its event loop (for calls from other threads)."""

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)


class DrainingServer(LoopServer):
    """On the first SIGTERM or SIGINT: refuse new clients, let every stream finish its buffered
    audio, send its verdict and close 1001, then stop (at most DRAIN_SECONDS). A second signal
    stops at once."""

    def __init__(self, config, app, quiet: bool = False):
        super().__init__(config)
        self.app, self.draining, self.quiet = app, False, quiet     # quiet: a worker (its edge says it)

    def handle_exit(self, sig, frame):
        if self.draining or sig not in (signal.SIGTERM, signal.SIGINT) or not hasattr(self.app.state, "hub"):
            return super().handle_exit(sig, frame)
        self.draining = True
        if not self.quiet:
            print(f"# {signal.Signals(sig).name}: draining {len(self.app.state.hub.connections)} streams",
                  file=sys.stderr, flush=True)
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        hub = self.app.state.hub
        await hub.drain()
        deadline = asyncio.get_running_loop().time() + DRAIN_SECONDS
        while hub.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)                        # the last verdicts and closes go out
        self.should_exit = True


def uvicorn_config(app, limits: Limits, streams: int, **options) -> uvicorn.Config:
    """uvicorn's settings for every server of the service (the server, a worker, the edge):
    the guarded protocols (app/serve/guard.py) with ``limits``, ``streams`` WebSocket
    connections counted against the descriptor limit; no compression (PCM does not compress)."""
    config = uvicorn.Config(app, http=GuardedHttp, ws=PatientWebSocket, ws_max_size=limits.message_bytes,
                            ws_ping_interval=limits.ping_seconds, ws_ping_timeout=limits.ping_seconds,
                            ws_per_message_deflate=False, h11_max_incomplete_event_size=HEAD_BYTES,
                            log_level="warning", **options)
    config.nystream_guard = Guard(limits, streams)
    return config


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def built_hub(spec):
    """``spec.build()``, or SystemExit with its error in one line (a missing or mismatched
    checkpoint, missing weights: what `classify` says of them)."""
    from audio.errors import AudioError
    from app.checkpoint import CheckpointError
    try:
        return spec.build()
    except (AudioError, CheckpointError, ValueError) as e:
        raise SystemExit(f"serve: error: {e}") from None


def package_version() -> str:
    """The installed package's version ("" when run from a checkout that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("nystream")
    except PackageNotFoundError:
        return ""


def host_port(host: str, port: int) -> str:
    """"HOST:PORT" as a URL writes it (an IPv6 address in brackets)."""
    return f"{host if ':' not in host else '[' + host + ']'}:{port}"


def serve_app(spec, token: str | None, sock: socket.socket, on_start, quiet: bool = False,
              public: Public = Public()) -> None:
    """Build the hub (a bad option: one line, exit 1), then serve its app on ``sock`` until
    SIGTERM / SIGINT has drained it; ``on_start(hub)`` once clients may connect."""
    from .service import build_app
    hub = built_hub(spec)
    app = build_app(lambda: hub, token=token, limits=spec.limits, version=package_version(), on_start=on_start,
                    origins=public.origins, loopback=public.loopback)
    config = uvicorn_config(app, spec.limits, 2 * hub.capacity, lifespan="on", **public.tls())
    DrainingServer(config, app, quiet=quiet).run(sockets=[sock])


def serve_forever(spec, token: str | None, host: str, port: int, public: Public = Public()) -> int:
    """Serve until SIGTERM / SIGINT (then drain). The line ``# serving ws://HOST:PORT/v1/stream``
    (``wss://`` with a certificate) on stderr says the models are loaded and clients may connect."""
    try:
        sock = bind(host, port)
    except ServeError as e:
        raise SystemExit(f"serve: {e}") from None
    where = host_port(host, sock.getsockname()[1])
    precision = getattr(getattr(spec, "frontend", None), "precision", "float32")

    def started(hub):
        print(f"# serving {public.urls(where)}: up to {hub.capacity} streams, front end {hub.frontend}, "
              f"models {', '.join(hub.models)}, {device_text(hub.device, precision)}{', token required' if token else ''}",
              file=sys.stderr, flush=True)
    serve_app(spec, token, sock, started, public=public)
    print("# stopped", file=sys.stderr, flush=True)
    return 0
