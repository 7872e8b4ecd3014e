"""Protocol version 1 of `serve` (docs/serve.md): the hello, the audio messages and the limits,
checked before anything is kept, and the server's default batch delay. A fault is a ProtocolError carrying the RFC 6455 close code and
a one-line reason."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

import numpy as np
import soxr

from audio.decoding import SourceStats, condition
from audio.melspec import SAMPLE_RATE

VERSION = 1
FORMATS = {"f32le": np.dtype("<f4"), "s16le": np.dtype("<i2")}

# RFC 6455 close codes
NORMAL, GOING_AWAY, UNSUPPORTED, INVALID, POLICY, TOO_BIG, SERVER_ERROR, TRY_LATER = (
    1000, 1001, 1003, 1007, 1008, 1009, 1011, 1013)


class ProtocolError(Exception):
    """A client's fault: close the connection with ``code`` and this one-line reason."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason[:120]      # a close reason is at most 123 bytes


# A lane's ready hop waits at most this for its other streams' hops (app/serve/hub.py; `serve
# --batch-delay-ms`): longer waits batch more streams a hop, for fewer cores and no worse latency
# (docs/benchmarks.md, design measurements).
BATCH_DELAY_MS = 40.0
SUMMED = ("active_streams", "capacity", "engine_hops", "stream_hops")     # /v1/health's sums over replicas or workers


def health_sums(healths: list[dict]) -> tuple[dict, list[int]]:
    """Several servers' ``/v1/health`` as one: the SUMMED counts added, and each one's active
    streams, busiest first."""
    return ({k: sum(h[k] for h in healths) for k in SUMMED},
            sorted((h["active_streams"] for h in healths), reverse=True))


@dataclass(frozen=True)
class Limits:
    hello_bytes: int = 1024             # the first text message
    message_bytes: int = 1 << 20        # any message (the WebSocket layer closes with 1009 beyond it)
    rates: tuple[int, int] = (8000, 192000)
    max_channels: int = 8
    speed: float = 4.0                  # at most this many times real time is read per client
    burst_seconds: float = 5.0          # ... beyond a first burst of this much audio
    credit_seconds: float = 4.0         # audio a client may send beyond its last record's (the hello reply says it)
    outbox_seconds: float = 5.0         # results a client may leave unread before it is closed
    hello_seconds: float = 10.0         # time to send the hello
    idle_seconds: float = 60.0          # a stream that sends nothing this long is closed (1008)
    lag_seconds: float = 30.0           # a stream this far behind real time is closed (1008) ...
    lag_grace_seconds: float = 10.0     # ... once this much time has passed since its hello
    streams_per_address: int = 8        # WebSocket connections of one client address at once (0: no cap)
    request_seconds: float = 10.0       # an HTTP request (a WebSocket upgrade too) must be whole within this
    requests: int = 256                 # HTTP connections not yet upgraded, at once (lowered to fit the descriptors)
    requests_per_address: int = 32      # ... of one client address, or its streams_per_address if more (0: no cap of its own)
    ping_seconds: float = 20.0          # keepalive: a ping this often, a pong expected within as long
    retry_seconds: float = 5.0          # what a 1013 asks the client to wait
    upload_bytes: int = 100 << 20       # a POSTed file (413 beyond it)

    def behind_edge(self) -> "Limits":
        """A worker's or replica's limits: every connection comes from the edge (app/serve/edge.py),
        which holds the per-address caps."""
        return replace(self, streams_per_address=0, requests_per_address=0)

    def doc(self) -> dict:
        return {"hello_bytes": self.hello_bytes, "message_bytes": self.message_bytes,
                "sample_rates": list(self.rates), "max_channels": self.max_channels,
                "speed": self.speed, "credit_seconds": self.credit_seconds, "outbox_seconds": self.outbox_seconds,
                "idle_seconds": self.idle_seconds, "lag_seconds": self.lag_seconds,
                "streams_per_address": self.streams_per_address, "request_seconds": self.request_seconds,
                "retry_seconds": self.retry_seconds, "upload_bytes": self.upload_bytes}


def try_later(what: str, limits: Limits) -> ProtocolError:
    """A 1013 whose reason says when to ask again (``listen`` reads it: ``retry_after``)."""
    return ProtocolError(TRY_LATER, f"{what}; retry in {limits.retry_seconds:g} s")


def retry_after(reason: str) -> float | None:
    """The seconds a 1013's reason asks the client to wait, None when it says none."""
    m = re.search(r"retry in ([0-9.]+) s", reason or "")
    return float(m.group(1)) if m else None


@dataclass(frozen=True)
class Hello:
    sample_rate: int
    channels: int
    format: str

    @property
    def frame_bytes(self) -> int:
        return FORMATS[self.format].itemsize * self.channels


def parse_hello(text: str | None, limits: Limits) -> Hello:
    """The client's first message -> Hello; ProtocolError (1003 or 1007) when it is not one."""
    if text is None:
        raise ProtocolError(UNSUPPORTED, "the first message must be the JSON hello (text), not binary")
    if len(text.encode("utf-8", "replace")) > limits.hello_bytes:
        raise ProtocolError(TOO_BIG, f"the hello is over {limits.hello_bytes} bytes")
    try:
        d = json.loads(text)
    except ValueError:
        raise ProtocolError(INVALID, "the hello is not JSON") from None
    if not isinstance(d, dict) or set(d) != {"sample_rate", "channels", "format"}:
        raise ProtocolError(INVALID, 'the hello must be {"sample_rate": int, "channels": int, '
                                     '"format": "f32le" | "s16le"}')
    rate, channels, fmt = d["sample_rate"], d["channels"], d["format"]
    lo, hi = limits.rates
    if type(rate) is not int or not lo <= rate <= hi:
        raise ProtocolError(INVALID, f"sample_rate must be an integer from {lo} to {hi} Hz")
    if type(channels) is not int or not 1 <= channels <= limits.max_channels:
        raise ProtocolError(INVALID, f"channels must be an integer from 1 to {limits.max_channels}")
    if type(fmt) is not str or fmt not in FORMATS:
        raise ProtocolError(UNSUPPORTED, f"unknown format {str(fmt)[:20]!r}; use f32le or s16le")
    return Hello(rate, channels, fmt)


def parse_control(text: str) -> None:
    """A text message after the hello: only {"end": true} (JSON true: 1 is not true); 1007 for
    another value of "end", 1003 for any other message."""
    try:
        d = json.loads(text)
    except ValueError:
        d = None
    if type(d) is dict and "end" in d:
        if list(d) == ["end"] and d["end"] is True:
            return
        raise ProtocolError(INVALID, '"end" must be JSON true, alone: {"end": true}')
    raise ProtocolError(UNSUPPORTED, 'after the hello, text messages are only {"end": true}')


class PcmDecoder:
    """Interleaved PCM messages -> 16 kHz mono float32, as a file's samples are made
    (audio/decoding.py: channels averaged, clipped to +-1, soxr resampling)."""

    def __init__(self, hello: Hello):
        self.hello, self.stats, self.frames = hello, SourceStats(), 0
        self.resampler = (soxr.ResampleStream(hello.sample_rate, SAMPLE_RATE, 1, dtype="float32")
                          if hello.sample_rate != SAMPLE_RATE else None)

    def feed(self, data: bytes) -> np.ndarray:
        h = self.hello
        if len(data) % h.frame_bytes:
            raise ProtocolError(INVALID, f"a message of {len(data)} bytes is not whole {h.format} frames "
                                         f"of {h.channels} channel(s) ({h.frame_bytes} bytes each)")
        x = np.frombuffer(data, FORMATS[h.format]).reshape(-1, h.channels)
        if h.format == "s16le":
            x = x.astype(np.float32) / 32768.0
        elif not np.isfinite(x).all():
            raise ProtocolError(INVALID, "the audio holds NaN or infinite samples")
        self.frames += len(x)
        mono = condition(x, self.stats)
        return self.resampler.resample_chunk(mono) if self.resampler is not None else mono

    def flush(self) -> np.ndarray:
        if self.resampler is None:
            return np.zeros(0, np.float32)
        return self.resampler.resample_chunk(np.zeros(0, np.float32), last=True)

    @property
    def seconds(self) -> float:
        return self.frames / self.hello.sample_rate


def first_line(e: BaseException) -> str:
    """An error's message, its first line only (a close reason or a one-line refusal)."""
    text = str(e)
    return text.splitlines()[0] if text else ""
