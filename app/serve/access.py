"""Who may use the service, checked before anything else of a request is read.

- **The token.** Programs send ``Authorization: Bearer TOKEN``. A browser's WebSocket cannot set
  headers, so a page offers two subprotocols, ``nystream`` and ``nystream.bearer.`` + the token
  in base64url without padding (as Kubernetes carries a bearer token on a WebSocket); the server
  answers ``nystream`` and never echoes the token. Compared in constant time.
- **The origin.** A browser names the page that opens a WebSocket or sends a cross-site POST in
  ``Origin``. Only the server's own origin and ``--allow-origin`` ones pass: another site's page
  cannot use a server on this machine (cross-site WebSocket hijacking). A request without
  ``Origin`` (a program) is not a page's and passes.
- **The host.** A server bound to loopback answers only requests addressed to a loopback name
  (``localhost``, ``127.0.0.1``, ``[::1]``): a site whose name an attacker points at 127.0.0.1
  (DNS rebinding) is its own origin, so the origin check alone would let it in.
"""
from __future__ import annotations

import base64
import binascii
import hmac
from dataclasses import dataclass, field
from urllib.parse import urlsplit

SUBPROTOCOL = "nystream"
BEARER = "nystream.bearer."
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def subprotocols(headers) -> list[str]:
    """The subprotocols a WebSocket upgrade offers, in its order."""
    return [p.strip() for p in (headers.get("sec-websocket-protocol") or "").split(",") if p.strip()]


def bearer_subprotocol(token: str) -> str:
    """The subprotocol that carries ``token`` (what a page offers beside ``nystream``)."""
    return BEARER + base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")


def token_given(headers) -> str | None:
    """The token a request carries: its Authorization header's, else its bearer subprotocol's."""
    auth = headers.get("authorization")
    if auth is not None:
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
    for p in subprotocols(headers):
        if p.startswith(BEARER):
            code = p[len(BEARER):]
            try:
                return base64.urlsafe_b64decode(code + "=" * (-len(code) % 4)).decode()
            except (binascii.Error, ValueError):
                return ""
    return None


def token_ok(headers, token: str | None) -> bool:
    """The request carries the server's token (any request when it has none)."""
    if token is None:
        return True
    given = token_given(headers)
    return given is not None and hmac.compare_digest(given.encode("utf-8", "replace"), token.encode())


def answer_subprotocol(headers) -> str | None:
    """``nystream`` when the upgrade offered it (a page), else None (a program offers none)."""
    return SUBPROTOCOL if SUBPROTOCOL in subprotocols(headers) else None


def host_name(authority: str) -> str:
    """The host of a ``host[:port]`` (an IPv6 address without its brackets), lower case."""
    return (urlsplit("//" + authority).hostname or "").lower()


@dataclass(frozen=True)
class Access:
    """One server's access rules: its token (None: none), the origins allowed beside its own, and
    whether it listens on loopback only."""
    token: str | None = None
    origins: frozenset = field(default_factory=frozenset)
    loopback: bool = True

    def refusal(self, headers) -> tuple[int, str] | None:
        """(HTTP status, one-line reason) when the request must be refused for its host or origin,
        else None. The token is checked apart (``token_ok``): a page without it may load."""
        host = headers.get("host") or ""
        if self.loopback and host_name(host) not in LOOPBACK_NAMES:
            return 403, f"this server answers requests to localhost only, not to {host[:60]!r}"
        origin = headers.get("origin")
        if origin is None or origin in self.origins:
            return None
        own = urlsplit(origin)
        if own.scheme in ("http", "https") and own.netloc.lower() == host.lower():
            return None
        return 403, f"requests from pages of {origin[:60]!r} are refused (serve --allow-origin admits one)"


class AccessGuard:
    """ASGI middleware: every HTTP request and WebSocket upgrade that ``access.refusal`` refuses
    is answered there (a JSON 403; an upgrade: 403 before any WebSocket exists)."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            from starlette.datastructures import Headers
            refusal = self.access.refusal(Headers(scope=scope))
            if refusal is not None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                from starlette.responses import JSONResponse
                status, reason = refusal
                await JSONResponse({"error": reason}, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
