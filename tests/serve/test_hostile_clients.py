"""Hostile clients against the real `serve` process (loopback only; every loop bounded in count
and time). The server runs with a low descriptor limit (256) and short deadlines, and each attack
runs beside a client with the token whose stream must come through whole:

- a flood of unfinished HTTP requests and oversized headers from many loopback addresses: the
  honest client and /v1/health are served meanwhile, a request is whole within the deadline or
  closed (408), an oversized header is answered 431 (or 400) and closed, and one address never
  holds more than its share of the server's HTTP-stage connections;
- a client sending 4 minutes of audio as fast as it can (`listen --pace fast`, which keeps to the
  server's credit) gets every record and one verdict over one connection; a plain client that
  ignores the credit is slowed, and its keepalive (pings every second) does not close it;
- a trickling client is closed 1008 once its audio falls behind real time; a fourth stream from
  one address is refused 1013 with when to retry;
- the server's stderr holds no "Task was destroyed" lines.
"""
import contextlib
import json
import re
import resource
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from app.cli import main
from audio_helpers import tone, write
from test_serve import HELLO, TOKEN, classify_jsonl, records_and_verdict, repeated, same

ROOT = Path(__file__).resolve().parents[2]
REQUEST_S = 2.0             # the server's request deadline here (default 10)
FDS = 256                   # the server's descriptor limit
PER_ADDRESS = 32            # HTTP-stage connections of one address (Limits.requests_per_address)


@pytest.fixture(scope="module")
def served(files, tmp_path_factory):
    """The real server: musicnn and the two tiny models, at most 6 streams, 3 per address."""
    checkpoints, _ = files
    d = tmp_path_factory.mktemp("hostile")
    (d / "token").write_text(TOKEN + "\n")

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (FDS, FDS))
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "main.py"), "serve", "--port", "0", "--token-file", str(d / "token"),
         *repeated("--checkpoint", checkpoints), "--max-streams", "6", "--max-streams-per-address", "3",
         "--request-seconds", f"{REQUEST_S:g}", "--ping-seconds", "1", "--client-speed", "40",
         "--max-lag-seconds", "3"], stderr=subprocess.PIPE, text=True, preexec_fn=low_limit)
    lines = []
    try:
        line = server.stderr.readline()
        while line and "# serving" not in line:
            lines.append(line)
            line = server.stderr.readline()
        assert line, "".join(lines)
        reader = threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True)
        reader.start()
        yield re.search(r"(ws://\S+/v1/stream)", line).group(1), lines
    finally:
        server.terminate()
        server.wait(timeout=60)
    noise = [x for x in lines if "Task was destroyed" in x or "Traceback" in x]
    assert not noise, "".join(lines[-40:])


def port_of(url: str) -> int:
    return int(url.split(":")[2].split("/")[0])


def from_address(address: str, port: int) -> socket.socket:
    """A TCP connection to the server from the loopback ``address`` (127.x.y.z)."""
    s = socket.socket()
    s.bind((address, 0))
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    return s


def closed(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing ``s`` within ``seconds``; None if still open."""
    s.settimeout(0.2)
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


def health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url.replace("ws://", "http://").replace("/v1/stream", "/v1/health"),
                                             timeout=10).read())


def client(url, address="127.0.0.1", **kw):
    return connect(url, sock=from_address(address, port_of(url)), additional_headers={"Authorization": f"Bearer {TOKEN}"},
                   proxy=None, open_timeout=20, **kw)


def honest(url, hops, address="127.0.0.1") -> tuple[list[dict], dict | None, int]:
    """A client with the token streaming ``hops`` at 0.05 s a hop: (records, verdict, close)."""
    records, verdict = [], None
    with client(url, address) as ws:
        ws.send(json.dumps(HELLO))
        ws.recv(timeout=30)

        def send():
            for hop in hops:
                ws.send(hop.astype("<f4").tobytes())
                time.sleep(0.05)
            ws.send(json.dumps({"end": True}))
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            for text in ws:
                d = json.loads(text)
                if "verdict" in d:
                    verdict = d
                else:
                    records.append(d)
        except ConnectionClosed:
            pass
        sender.join(timeout=60)
        return records, verdict, ws.close_code


def test_a_flood_of_unfinished_requests_starves_no_one(served, files, capsys, errors):
    url, _ = served
    port = port_of(url)
    checkpoints, songs = files
    want = classify_jsonl(capsys, songs["a"], checkpoints)
    from audio.sources import FileSource
    hops = list(FileSource(songs["a"]))
    # one address over its share: its oldest connections are closed as new ones come
    mine = [from_address("127.0.0.5", port) for _ in range(PER_ADDRESS + 8)]
    for s in mine:
        s.sendall(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\n")
    time.sleep(0.5)                                      # (well inside the deadline)
    ready = set(select.select(mine, [], [], 0)[0])       # closed: readable (at end of file)
    assert [s in ready for s in mine] == [True] * 8 + [False] * PER_ADDRESS     # the oldest 8 went
    # 300 unfinished requests from 15 addresses, more than the descriptor limit leaves room for
    flood = []
    for i in range(300):
        s = from_address(f"127.0.1.{10 + i % 15}", port)
        s.sendall(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\n")
        flood.append(s)
    # oversized headers: whole (the websockets parser refuses the line) and in pieces (h11 refuses the head)
    big = from_address("127.0.2.1", port)
    big.sendall(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                b"X-Pad: " + b"a" * 9000 + b"\r\n\r\n")
    pieces = from_address("127.0.2.2", port)
    for _ in range(10):
        pieces.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n" if _ else b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
    # meanwhile: health answers and the honest client's stream comes through whole
    assert health(url)["capacity"] == 6
    records, verdict, code = honest(url, hops)
    assert code == 1000 and verdict["hops"] == len(want)
    same(errors, records, want)
    answer = closed(big, 10)
    assert answer is not None and answer.split(b" ")[1] in (b"431", b"400"), answer[:80]
    answer = closed(pieces, 10)
    assert answer is not None and answer.split(b" ")[1] in (b"431", b"400"), answer[:80]
    # every unfinished request is closed by the deadline (evicted ones earlier): with a 408 or nothing
    answers = [closed(s, REQUEST_S + 10) for s in flood + mine]
    assert all(a is not None for a in answers), sum(a is None for a in answers)
    assert {a.split(b"\r\n")[0] for a in answers if a} <= {b"HTTP/1.1 408 Request Timeout"}
    for s in flood + mine + [big, pieces]:
        s.close()


def test_four_minutes_sent_as_fast_as_possible_arrive_over_one_connection(served, tmp_path, capsys):
    """`listen --pace fast` keeps to the server's credit: 960 hops, 960 records, one verdict over
    every hop, no reconnection. The server reads at most 40x real time (after a first 5 s), so
    the client is held back for about 6 s, three times what its keepalive allows (a ping every
    second, its pong within a second): a client whose pongs waited behind its audio is closed."""
    url, _ = served
    minutes = np.concatenate([tone(30.0, 16000, f) for f in (220.0, 330.0, 440.0, 550.0) * 2])
    song = write(tmp_path / "four.wav", minutes, 16000, "PCM_16")
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert main(["listen", url, str(song), "--pace", "fast", "--jsonl", "--token-file", str(tmp_path / "token")]) == 0
    out = capsys.readouterr()
    steps = [x["step"] for x in records_and_verdict(out.out)[0]]
    assert steps == list(range(960))
    assert "dropped" not in out.err and ": 960 hops," in out.err and out.err.count("# verdict over ws:") == 1


def test_a_client_that_ignores_the_credit_is_slowed_not_closed(served):
    """2 minutes of audio in 1 MiB messages at once, pings every second: the server stops
    reading it for many seconds at a time (its pongs wait unread behind the audio), and the
    connection holds: every record, the verdict, close 1000."""
    url, _ = served
    audio = np.concatenate([tone(10.0, 16000, f) for f in (220.0, 440.0) * 6]).astype("<f4").tobytes()
    with client(url, ping_interval=None, max_size=None) as ws:
        ws.send(json.dumps(HELLO))
        assert json.loads(ws.recv(timeout=30))["credit_seconds"] > 0
        records, verdict, start = 0, None, time.monotonic()

        def send():
            for i in range(0, len(audio), 1 << 20):
                ws.send(audio[i:i + (1 << 20)])
            ws.send(json.dumps({"end": True}))
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        for text in ws:
            d = json.loads(text)
            if "verdict" in d:
                verdict = d
            else:
                records += 1
        sender.join(timeout=60)
        assert (ws.close_code, records, verdict["hops"]) == (1000, 480, 480)
        assert time.monotonic() - start > 2.0                   # longer than a ping and its timeout


def test_a_trickling_client_is_closed_and_one_address_holds_three_streams(served, files):
    url, _ = served
    with client(url, "127.0.3.1") as trickle:
        trickle.send(json.dumps(HELLO))
        trickle.recv(timeout=30)
        start = time.monotonic()
        with pytest.raises(ConnectionClosed):
            while time.monotonic() - start < 40:
                trickle.send(b"\0\0\0\0")                        # a sample every 0.2 s
                time.sleep(0.2)
        late = time.monotonic() - start
    assert (trickle.close_code, trickle.close_reason) == (1008, "the audio fell over 3 s behind real time; closed")
    assert 9.5 < late < 30, late                                # after the 10 s grace
    with contextlib.ExitStack() as held:
        for _ in range(3):
            ws = held.enter_context(client(url, "127.0.3.2"))
            ws.send(json.dumps(HELLO))
            ws.recv(timeout=30)
        with client(url, "127.0.3.2") as fourth:
            with pytest.raises(ConnectionClosed):
                fourth.recv(timeout=30)
            assert fourth.close_code == 1013
            assert fourth.close_reason == "this address has 3 streams open, the most one address may; retry in 5 s"
        with client(url, "127.0.3.3") as other:                 # another address is served
            other.send(json.dumps(HELLO))
            assert "classes" in json.loads(other.recv(timeout=30))
