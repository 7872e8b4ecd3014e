"""Client helpers for the serve tests that run a server in its own process or on Ray: a
connection whose hello was accepted, and a stream of hops into it with its records read."""
import json
import threading
import time

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from test_serve import HELLO


def accepted(url):
    """A connection whose hello was accepted (retrying a full replica's or worker's 1013)."""
    for _ in range(20):
        ws = connect(url, proxy=None, open_timeout=30).__enter__()
        ws.send(json.dumps(HELLO))
        try:
            json.loads(ws.recv(timeout=30))
            return ws
        except ConnectionClosed:
            assert ws.close_code == 1013
    raise AssertionError("no replica took the stream")


def stream(ws, hops, got: dict, pace: float) -> None:
    """Send ``hops`` every ``pace`` s, then end; ``got``: the records, verdict, close code and reason."""
    records, verdict = [], None

    def send():
        try:
            for hop in hops:
                ws.send(hop.astype("<f4").tobytes())
                time.sleep(pace)
            ws.send(json.dumps({"end": True}))
        except ConnectionClosed:
            pass
    threading.Thread(target=send, daemon=True).start()
    try:
        for text in ws:
            d = json.loads(text)
            verdict = d if "verdict" in d else verdict
            if "verdict" not in d:
                records.append(d)
    except ConnectionClosed:
        pass
    got.update(records=records, verdict=verdict, close=ws.close_code, reason=ws.close_reason)
