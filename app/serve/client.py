"""`listen`: stream a file, the demo signal or the microphone to a `serve` server (protocol v1)
and print what `classify` prints: a line (or a JSON line, or a CSV row) per hop, then the verdict.

Audio is sent as it is classified locally: 16 kHz mono float32 hops (the file decoded and
resampled exactly as `classify` does it), at real-time pace unless ``fast``, and never more than
the server's credit (its hello reply's ``credit_seconds``) beyond the last record received, so
the server never has to hold the client back. If the connection drops without a verdict (a
worker or replica died), a fresh stream carries on with the rest of the audio, said in one line.
"""
from __future__ import annotations

import collections
import json
import sys
import threading
import time
from dataclasses import dataclass

from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from app.runtime.records import csv_row, human, record_from_dict
from app.runtime.verdict import Verdict, verdict_table

from audio.melspec import HOP_SECONDS

from .protocol import GOING_AWAY, NORMAL, TRY_LATER, retry_after

HELLO = json.dumps({"sample_rate": 16000, "channels": 1, "format": "f32le"})
RECONNECTS = 3
FULL_TRIES, FULL_WAIT_S = 10, 2.0       # a full server (1013): ask again (after the wait its reason names, else
MAX_WAIT_S = 60.0                       # FULL_WAIT_S; at most MAX_WAIT_S), up to FULL_TRIES times


class ListenError(Exception):
    """The server refused or dropped the stream, in one line."""


@dataclass
class Printer:
    jsonl: bool = False
    rows: object = None             # CsvRows or None

    def record(self, text: str) -> None:
        r = record_from_dict(json.loads(text))
        if self.jsonl:
            print(text, flush=True)
        elif self.rows is not None:
            self.rows.write(csv_row(r))
        else:
            print(f"{r.source}  {human(r)}", flush=True)

    def verdict(self, d: dict) -> None:
        """The server's verdict message: on stdout as it came with --jsonl (classify's verdict
        record), and as a table on stderr."""
        if self.jsonl:
            print(json.dumps(d), flush=True)
        verdicts = [Verdict(name, **v) for name, v in d["verdict"].items()]
        print(f"# {d['source']}: {d['hops']} hops, {d['nonfinite_zeroed']} non-finite samples zeroed, "
              f"{d['clipped']} samples clipped", file=sys.stderr)
        if verdicts:
            print(f"# verdict over {d['source']}, per model:\n"
                  + "\n".join(f"#   {line}" for line in verdict_table(verdicts).splitlines()), file=sys.stderr)


class Hops:
    """The source's hops, shared by successive connections: a connection that drops gives back
    the hops it took that no record answered (in flight, or sent as the server failed), and the
    next connection sends them first, so no audio is lost between the two streams."""

    def __init__(self, source):
        self.it, self.lock, self.done = iter(source), threading.Lock(), False
        self.again: collections.deque = collections.deque()
        self.answered = 0                 # hops whose records came back, over every connection

    def next(self):
        with self.lock:
            if self.again:
                return self.again.popleft()
            try:
                return next(self.it)
            except StopIteration:
                self.done = True
                return None

    def give_back(self, hops: list) -> None:
        with self.lock:
            self.again.extendleft(reversed(hops))


class Credit:
    """How far ahead of the records the sender may be: ``credit_seconds`` of audio beyond the
    ``audio_time`` of the last record received (None: no limit, a server that grants none)."""

    def __init__(self, seconds: float | None):
        self.seconds, self.answered, self.changed = seconds, 0.0, threading.Condition()

    def wait(self, sent: float, stop: threading.Event) -> None:
        """Until ``sent`` seconds of audio are within the credit (or ``stop``)."""
        with self.changed:
            while self.seconds is not None and sent > self.answered + self.seconds and not stop.is_set():
                self.changed.wait(0.1)

    def record(self, audio_time: float) -> None:
        with self.changed:
            self.answered = audio_time
            self.changed.notify_all()


def send_all(ws, hops: Hops, taken: list, stop: threading.Event, failed: list, credit: Credit) -> None:
    """The hops (each kept in ``taken`` before it is sent, each within the credit), then the
    end; a source that fails (a file damaged mid-way, a lost microphone) is kept in ``failed``
    and the connection closed."""
    try:
        while not stop.is_set():
            hop = hops.next()
            if hop is None:
                ws.send(json.dumps({"end": True}))
                return
            taken.append(hop)
            credit.wait(len(taken) * HOP_SECONDS, stop)
            ws.send(hop.astype("<f4").tobytes())
    except ConnectionClosed:
        pass
    except Exception as e:  # noqa: BLE001 - the source's error, said by listen in one line
        failed.append(e)
        ws.close()


def one_stream(url: str, token: str | None, hops: Hops, printer: Printer) -> tuple[str, str]:
    """One connection: ("done", "") after the verdict and a normal close, ("dropped", "") if it
    broke first, ("full", reason) if the server had no free stream (1013, before any audio);
    ListenError when the server refused or closed the stream with an error."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        ws = connect(url, additional_headers=headers, open_timeout=30, max_size=1 << 22)
    except InvalidStatus as e:
        raise ListenError(f"the server refused the connection: HTTP {e.response.status_code}"
                          + (" (a missing or wrong token)" if e.response.status_code in (401, 403) else "")) from None
    except (OSError, TimeoutError) as e:
        raise ListenError(f"cannot connect to {url}: {e}") from None
    stop, verdict, failed, sender, taken, answered = threading.Event(), None, [], None, [], 0
    with ws:
        ws.send(HELLO)
        try:
            credit = Credit(json.loads(ws.recv(timeout=30)).get("credit_seconds"))   # {"classes", "models", ...}
            sender = threading.Thread(target=send_all, args=(ws, hops, taken, stop, failed, credit), daemon=True)
            sender.start()
            for text in ws:
                d = json.loads(text)
                if "verdict" in d:
                    verdict = d
                    printer.verdict(d)
                else:
                    printer.record(text)
                    answered += 1
                    credit.record(answered * HOP_SECONDS)    # this stream's audio, in the hops it was sent as
        except ConnectionClosed:
            pass
        finally:
            stop.set()
        code, reason = (ws.close_code, ws.close_reason) if ws.close_code is not None else (1006, "")
    if sender is not None:
        sender.join(timeout=10)          # the socket is closed: its next send returns at once
    hops.answered += answered
    if failed:
        raise failed[0]
    if verdict is not None and code in (NORMAL, GOING_AWAY):
        return "done", ""
    if code == TRY_LATER and sender is None:
        return "full", reason
    if code in (1006, 1011, 1012) and (not hops.done or len(taken) > answered):
        hops.give_back(taken[answered:])
        return "dropped", ""
    raise ListenError(f"the server closed the stream: {code} {reason or '(no reason)'}")


def listen(url: str, source, token: str | None, printer: Printer) -> int:
    """Stream ``source`` to its verdict: a dropped connection is resumed as a fresh stream (up to
    RECONNECTS times), a full server (1013) is asked again after the wait its reason names (else
    FULL_WAIT_S; up to FULL_TRIES times), each said in one line."""
    hops, dropped, full = Hops(source), 0, 0
    while True:
        outcome, reason = one_stream(url, token, hops, printer)
        if outcome == "done":
            return 0
        if outcome == "full":
            full += 1
            if full == FULL_TRIES:
                raise ListenError(f"the server stayed full (1013) for {FULL_TRIES} tries: {reason}")
            wait = min(retry_after(reason) or FULL_WAIT_S, MAX_WAIT_S)
            print(f"# the server is full (1013: {reason}); asking again in {wait:g} s", file=sys.stderr, flush=True)
            time.sleep(wait)
            continue
        dropped += 1
        if dropped > RECONNECTS:
            raise ListenError(f"the connection dropped {RECONNECTS + 1} times")
        print(f"# the connection dropped after {hops.answered * HOP_SECONDS:.2f} s of audio classified; "
              f"reconnecting: a fresh stream from there", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- bench --serve

async def timed_client(url: str, hops: list, start: float) -> dict:
    """One client sending hop k when its last sample "plays" (start + (k + 1) * 0.25 s) and
    timing each record from that send: {"latencies" (ms), "records", "verdict", "close",
    "probabilities" (step -> each model's)}."""
    import asyncio

    from websockets.asyncio.client import connect as connect_async
    sent: dict[int, float] = {}
    latencies, verdict, probabilities = [], None, {}
    async with connect_async(url, proxy=None, max_size=1 << 22, open_timeout=60) as ws:
        await ws.send(HELLO)
        await ws.recv()

        async def send():
            for k, hop in enumerate(hops):
                await asyncio.sleep(max(0.0, start + (k + 1) * HOP_SECONDS - time.monotonic()))
                sent[k] = time.monotonic()
                await ws.send(hop.astype("<f4").tobytes())
            await ws.send(json.dumps({"end": True}))

        sender = asyncio.create_task(send())
        async for text in ws:
            d = json.loads(text)
            if "verdict" in d:
                verdict = d
            else:
                latencies.append((time.monotonic() - sent[d["step"]]) * 1e3)
                probabilities[d["step"]] = [m["probabilities"] for m in d["models"].values()]
        await sender
        return {"latencies": latencies, "records": len(latencies), "verdict": verdict is not None,
                "close": ws.close_code, "probabilities": probabilities}


async def timed_clients(url: str, audio: list[list]) -> list[dict]:
    """Every client of ``audio`` (its hops) at once, their starts spread over one hop."""
    import asyncio
    t0 = time.monotonic() + 0.5
    return await asyncio.gather(*(timed_client(url, hops, t0 + i * HOP_SECONDS / len(audio))
                                  for i, hops in enumerate(audio)))
