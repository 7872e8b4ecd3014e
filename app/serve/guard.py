"""The connection layer under the service's ASGI apps (the server's, a worker's, the edge's):
uvicorn's own HTTP and WebSocket protocol classes with the deadlines and caps a public socket
needs before any token is checked (docs/serve.md, "Threat model").

- ``GuardedHttp`` (uvicorn's h11 protocol): a request, a WebSocket upgrade included, must be whole
  within ``Limits.request_seconds`` of the connection's start or of the previous response (else
  408 and a close; uvicorn itself times out none). Connections still in their HTTP stage are
  capped per server and per client address; at a cap the oldest such connection is closed, so a
  flood costs itself its own connections, never a new client's request.
- ``AddressStreams`` (in the apps, once the token is checked): WebSocket connections per client
  address and in all.
- ``PatientWebSocket`` (uvicorn's websockets-sansio protocol): a keepalive pong that waits behind
  messages the app has not taken yet (the server is slowing the client down) does not close the
  connection; a handshake the websockets parser refuses (a header line over 8 KiB, too many
  headers) is answered with its 414/431 and closed (uvicorn leaves it open and unanswered); a
  frame it refuses (over ``Limits.message_bytes``: 1009) is answered with its close frame, then
  the rest of what the client sends is read and dropped for up to ``LINGER_S`` until it closes
  (uvicorn closes at once, and the unread bytes make TCP reset the connection, so the client
  may see 1006 instead of the code).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from .protocol import Limits, try_later

HEAD_BYTES = 8192                   # an HTTP request head arriving in pieces: 431 beyond this
LINGER_S = 2.0                      # after a refused frame's close: what the client still sends, read and dropped
RESERVED_FDS = 64                   # descriptors kept for the engine, logs, Ray, the listening socket
TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
log = logging.getLogger("nystream.serve")


class Guard:
    """One server's HTTP-stage connections, oldest first, by client address."""

    def __init__(self, limits: Limits, streams: int):
        self.seconds = limits.request_seconds
        self.total = fitting(limits.requests, streams)
        # an address allowed N streams may open N at once (0: no cap of its own)
        self.per_address = (max(limits.requests_per_address, limits.streams_per_address)
                            if limits.requests_per_address else self.total)
        self.open: dict[GuardedHttp, None] = {}                       # insertion order: oldest first
        self.by_address: dict[str, dict[GuardedHttp, None]] = collections.defaultdict(dict)
        self.evicted = 0

    def admit(self, conn: "GuardedHttp") -> None:
        mine = self.by_address[conn.address]
        if len(mine) >= self.per_address:
            self.evict(next(iter(mine)))
        if len(self.open) >= self.total:
            self.evict(next(iter(self.open)))
        self.open[conn] = None
        mine[conn] = None

    def release(self, conn: "GuardedHttp") -> None:
        if conn not in self.open:
            return
        del self.open[conn]
        mine = self.by_address[conn.address]
        del mine[conn]
        if not mine:
            del self.by_address[conn.address]

    def evict(self, conn: "GuardedHttp") -> None:
        self.evicted += 1
        if self.evicted in (1, 10, 100) or self.evicted % 1000 == 0:
            log.warning("%d HTTP connections closed to admit newer ones (at most %d at once, %d per address)",
                        self.evicted, self.total, self.per_address)
        self.release(conn)
        conn.transport.close()


def fitting(wanted: int, streams: int) -> int:
    """``wanted`` HTTP-stage connections, fewer where the descriptor limit (RLIMIT_NOFILE) would
    not also hold ``streams`` WebSocket connections (two descriptors each, for a relaying edge)
    and RESERVED_FDS; at least 8."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(8, min(wanted, soft - RESERVED_FDS - 2 * streams))


class AddressStreams:
    """The WebSocket connections open at once: at most ``limits.streams_per_address`` of one
    client address (0: no cap), and at most twice the streams in all (connections beyond the
    streams are waiting for their hello, or about to hear 1013)."""

    def __init__(self, limits: Limits):
        self.limits, self.by_address, self.total = limits, collections.Counter(), 0

    @contextlib.contextmanager
    def held(self, ws, streams: int):
        """One connection's place while the block runs; the block gets the 1013 to close with
        when there is none (else None)."""
        address = ws.client.host if ws.client else ""
        cap = self.limits.streams_per_address
        if cap and self.by_address[address] >= cap:
            yield try_later(f"this address has {cap} streams open, the most one address may", self.limits)
            return
        if self.total >= 2 * streams:
            yield try_later(f"the server is full ({streams} streams)", self.limits)
            return
        self.by_address[address] += 1
        self.total += 1
        try:
            yield None
        finally:
            self.total -= 1
            self.by_address[address] -= 1
            if not self.by_address[address]:
                del self.by_address[address]


class GuardedHttp(H11Protocol):
    """uvicorn's h11 protocol with a request deadline and the Guard's caps."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.guard: Guard = self.config.nystream_guard
        self.address = self.client[0] if self.client else ""
        self.seen_scope, self.deadline = None, None
        self.guard.admit(self)
        self.arm()

    def arm(self) -> None:
        self.disarm()
        self.deadline = self.loop.call_later(self.guard.seconds, self.timed_out)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def timed_out(self) -> None:
        self.deadline = None
        if not self.transport.is_closing():
            self.transport.write(TIMED_OUT)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.scope is not self.seen_scope:              # a request's head is whole
            self.seen_scope = self.scope
            self.disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():                # the next request: whole within the deadline too
            self.arm()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self.disarm()
        self.guard.release(self)
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc) -> None:
        self.disarm()
        self.guard.release(self)
        super().connection_lost(exc)


class PatientWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol, patient with pongs the server has not read yet,
    closing a handshake that the websockets parser refused, and lingering after a refused frame."""

    lingering = False

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return                                         # after a refused frame: dropped
        super().data_received(data)
        if not self.handshake_initiated and self.conn.handshake_exc is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.conn.data_to_send()))      # its 414 / 431, if it made one
            self.transport.close()

    def handle_parser_exception(self) -> None:
        """uvicorn's (the app told, the close frame sent), then no more writes and the reads
        dropped until the client closes, at most LINGER_S: its close code arrives whole."""
        close = self.conn.close_sent
        self.queue.put_nowait({"type": "websocket.disconnect", "code": close.code, "reason": close.reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def keepalive_timeout(self) -> None:
        if self.read_paused and not self.transport.is_closing():
            # the app has not taken the client's last message (it is slowing the client down):
            # the pong may be behind it, unread. Wait on; the app's own deadlines still hold.
            self.pong_timer = self.loop.call_later(self.ping_timeout, self.keepalive_timeout)
            return
        super().keepalive_timeout()
