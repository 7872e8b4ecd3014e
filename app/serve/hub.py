"""The server's engine loop: one Engine (app/runtime/engine.py) whose streams are network
connections. On the CPU its shards (one per core) are lanes: each lane is stepped by a thread of
its own, in a loop of its own, whenever one of its streams has a whole hop, and waits for no
other lane (a lane that the event loop's thread holds up delays only its own streams). On CUDA
there is one lane. sherpa-onnx's server loop, per lane: a hop waits for the lane's other streams'
hops at most ``batch_delay`` after the oldest waiting one arrived (BATCH_DELAY_MS unless `serve
--batch-delay-ms` says), and not at all once every stream of the lane has one (as Triton's
dynamic batcher's queue delay). The event loop feeds each connection's audio in and takes its
records out; a shard is touched by its lane's thread only.

A connection (``Connection``) owns its audio source (``NetworkSource``), its outbox of records
and its tally. A client that leaves, fails or stops reading closes only its own connection: its
source ends, and its slot is free at its lane's next hop.
"""
from __future__ import annotations

import asyncio
import collections
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from app.runtime.engine import Engine, default_shards
from app.runtime.verdict import Tally, verdict_message
from audio.melspec import HOP, HOP_SECONDS

from .protocol import (BATCH_DELAY_MS, GOING_AWAY, NORMAL, POLICY, SERVER_ERROR, Hello, Limits, PcmDecoder, ProtocolError,
                       first_line, try_later)


class NetworkSource:
    """A connection's audio as hops, for the engine: ``next()`` gives a whole hop, None while the
    next one is incomplete, and ends once the client has ended (or left) and every hop is taken.
    As a file's: the trailing partial hop is not classified; a stream shorter than one hop gives
    one zero-padded hop."""

    def __init__(self, name: str, decoder: PcmDecoder):
        self.name, self.decoder, self.stats = name, decoder, decoder.stats
        self.input_rate = decoder.hello.sample_rate
        self.ready: collections.deque = collections.deque()      # (time.monotonic() it was made, hop)
        self.pending, self.made = np.zeros(0, np.float32), 0
        self.ended = False

    def push(self, samples: np.ndarray) -> None:
        """16 kHz samples (event-loop thread); none once the stream has ended (a drain ends it
        while the client may still be sending)."""
        if self.ended:
            return
        self.pending = np.concatenate([self.pending, samples])
        now = time.monotonic()
        while len(self.pending) >= HOP:
            self.ready.append((now, self.pending[:HOP].copy()))
            self.pending, self.made = self.pending[HOP:], self.made + 1

    def end(self) -> None:
        if self.ended:
            return
        self.push(self.decoder.flush())
        if self.made == 0 and len(self.pending):
            self.ready.append((time.monotonic(), np.pad(self.pending, (0, HOP - len(self.pending)))))
        self.ended = True

    def close(self) -> None:
        """The client is gone: no more hops."""
        self.ready.clear()
        self.ended = True

    def oldest(self) -> float | None:
        """When the oldest hop not yet taken was made (time.monotonic()), None without one."""
        ready = self.ready
        return ready[0][0] if ready else None

    def __iter__(self):
        return self

    def __next__(self):
        ended = self.ended                  # read first: every hop of an ended source is queued
        try:
            _, hop = self.ready.popleft()
        except IndexError:                  # none (or the client left meanwhile: close() cleared them)
            if ended or self.ended:
                raise StopIteration from None
            return None
        self.stats.hops += 1
        return hop


FINISHED = None                             # the outbox's last item: every record is out, the verdict may follow


class Connection:
    """One client's stream: its source, outbox (records as JSON text) and verdict."""

    def __init__(self, name: str, hello: Hello, limits: Limits):
        self.source = NetworkSource(name, PcmDecoder(hello))
        self.stream = None                  # its Stream in the engine, once joined
        self.outbox: asyncio.Queue = asyncio.Queue()     # records as JSON text, then FINISHED
        self.outbox_limit = max(1, int(limits.outbox_seconds / HOP_SECONDS))
        self.failure: asyncio.Future = asyncio.get_running_loop().create_future()
        self.tally = Tally()
        self.close_code = NORMAL
        self.error: str | None = None

    def fail(self, code: int, reason: str) -> None:
        self.source.close()
        if not self.failure.done():
            self.failure.set_result((code, reason))

    def verdict(self) -> dict:
        return verdict_message(self.tally, self.source, self.error)


class Hub:
    """The engine and its connections. ``open(hello)`` joins a stream (ProtocolError 1013 when
    full, 1001 while draining); ``run()`` is the loop; ``drain()`` ends every stream."""

    def __init__(self, frontend, entries, capacity: int, limits: Limits, *, device: str = "cpu",
                 batch_delay: float = BATCH_DELAY_MS / 1e3):
        shards = default_shards(torch.device(device), capacity)
        if shards > 1:                                   # each lane's thread gets an even share of torch's (process-wide)
            torch.set_num_threads(max(1, torch.get_num_threads() // shards))
        self.engine = Engine(frontend, entries, capacity, shards=shards)
        self.engine.warm()                               # compiled before the first client, not in its hops
        self.capacity, self.limits, self.device = capacity, limits, device
        self.batch_delay = batch_delay                   # seconds a ready hop may wait for its lane's others
        self.models = [e.name for e in entries]
        self.classes = list(entries[0].classes) if entries else []
        self.frontend = frontend.description
        self.lanes = len(self.engine.shards)
        self.pools = [ThreadPoolExecutor(1, thread_name_prefix=f"lane{i}") for i in range(self.lanes)]
        self.connections: dict[str, Connection] = {}
        self.draining, self.joined = False, 0
        self.wakes: list[asyncio.Event] = []
        self.load = [0] * self.lanes                     # streams placed in each lane, joining ones included
        self.engine_hops = self.stream_hops = 0          # lane hops that stepped a stream; records made

    # ------------------------------------------------------------------ connections
    async def open(self, hello: Hello, kind: str = "ws") -> Connection:
        """A new stream named ``kind:N`` (``ws``: a WebSocket client; ``upload``: a posted file)."""
        if self.draining:
            raise ProtocolError(GOING_AWAY, "the server is shutting down")
        full = try_later(f"the server is full ({self.capacity} streams)", self.limits)
        try:
            lane = self.engine.place(self.load)          # joins run on the lanes' threads: the shards' counts lag
        except ValueError:
            raise full from None
        self.load[lane] += 1
        conn = Connection(f"{kind}:{self.joined}", hello, self.limits)
        self.joined += 1
        try:
            conn.stream = await self._engine(lane, self.engine.join, conn.source, lane)
        except BaseException as e:
            self.load[lane] -= 1
            if isinstance(e, ValueError):                # every slot taken (a leaver not yet gone)
                raise full from None
            raise
        self.connections[conn.source.name] = conn        # after the join: the loop retires no stream it cannot see
        return conn

    def feed(self, conn: Connection, data: bytes) -> None:
        conn.source.push(conn.source.decoder.feed(data))
        self.poke(conn)

    def end(self, conn: Connection) -> None:
        conn.source.end()
        self.poke(conn)

    def gone(self, conn: Connection) -> None:
        """The client left or failed: its stream ends at its lane's next hop."""
        conn.source.close()
        self.poke(conn)

    def poke(self, conn: Connection | None = None) -> None:
        """Wake the lane of ``conn`` (every lane without one)."""
        if not self.wakes:
            return
        if conn is not None and conn.stream is not None:
            self.wakes[conn.stream.shard].set()
        else:
            for wake in self.wakes:
                wake.set()

    async def drain(self) -> None:
        """Refuse new clients; end every stream (its buffered audio still classified)."""
        self.draining = True
        for conn in list(self.connections.values()):
            conn.close_code = GOING_AWAY
            self.end(conn)

    # ------------------------------------------------------------------ the loop
    async def _engine(self, lane: int, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pools[lane], fn, *args)

    def batch_wait(self, lane: int | None = None) -> float | None:
        """Seconds the lane's next hop waits for more of its streams' hops (dynamic batching, as
        Triton's dynamic batcher's queue delay): 0 when every stream of the lane has a hop or has
        ended, else until the oldest waiting hop has waited ``batch_delay``; None when no stream of
        the lane has a hop. ``lane`` None: every connection."""
        oldest, everyone = None, True
        for conn in self.connections.values():
            if lane is not None and conn.stream.shard != lane:
                continue
            source = conn.source
            since = source.oldest()
            if since is not None:
                oldest = since if oldest is None else min(oldest, since)
            elif source.ended:
                return 0.0                  # its stream leaves at the next hop
            else:
                everyone = False
        if oldest is None:
            return None
        return 0.0 if everyone else max(0.0, oldest + self.batch_delay - time.monotonic())

    async def run(self) -> None:
        """Every lane's loop, until cancelled."""
        self.wakes = [asyncio.Event() for _ in range(self.lanes)]
        await asyncio.gather(*(self._lane(i) for i in range(self.lanes)))

    async def _lane(self, lane: int) -> None:
        wake, shard = self.wakes[lane], self.engine.shards[lane]
        while True:
            await wake.wait()
            wake.clear()
            wait = self.batch_wait(lane)
            while wait:                     # more hops may arrive (each feed pokes): look again
                try:
                    await asyncio.wait_for(wake.wait(), wait)
                except asyncio.TimeoutError:
                    pass
                wake.clear()
                wait = self.batch_wait(lane)
            if wait is None:                # nothing to step (a hop taken meanwhile, a client idle)
                continue
            mine = [c for c in self.connections.values() if c.stream.shard == lane]
            try:
                records = await self._engine(lane, shard.hop)
            except Exception as e:  # noqa: BLE001 - a lane's fault ends its streams, not the server
                for conn in mine:
                    conn.fail(SERVER_ERROR, f"server error: {type(e).__name__}: {first_line(e)}")
                records = []
            if records:
                self.engine_hops, self.stream_hops = self.engine_hops + 1, self.stream_hops + len(records)
            for r in records:
                conn = self.connections.get(r.source)
                if conn is None:
                    continue
                conn.tally.add(r)
                if conn.outbox.qsize() >= conn.outbox_limit:
                    conn.fail(POLICY, f"results unread for {self.limits.outbox_seconds:g} s; closed")
                else:
                    conn.outbox.put_nowait(r.to_json())
            self._retire(lane)
            if any(c.source.ready or c.source.ended for c in mine):
                wake.set()

    def _retire(self, lane: int) -> None:
        """The lane's connections whose stream has left its shard: their records are all out.
        (The engine's list of failed streams is not kept: each connection's stream says its own.)"""
        self.engine.errors.clear()
        active = {id(s) for s in self.engine.shards[lane].streams}
        for name in [n for n, c in self.connections.items() if c.stream.shard == lane and id(c.stream) not in active]:
            conn = self.connections.pop(name)
            self.load[lane] -= 1
            if conn.stream.error is not None:
                conn.error = conn.stream.error
                conn.fail(SERVER_ERROR, conn.error)
            conn.outbox.put_nowait(FINISHED)

    def health(self) -> dict:
        return {"active_streams": len(self.connections), "capacity": self.capacity, "models": self.models,
                "frontend": self.frontend, "device": self.device, "draining": self.draining,
                "engine_hops": self.engine_hops, "stream_hops": self.stream_hops, "streams_by_lane": list(self.load)}


def hello_reply(hub: Hub) -> str:
    """The server's answer to a hello: the classes, the models, and the credit: how many seconds
    of audio the client may send beyond the ``audio_time`` of the last record it has received
    (a client that keeps to it is never held back by the server's reading)."""
    return json.dumps({"classes": hub.classes, "models": hub.models, "credit_seconds": hub.limits.credit_seconds})
