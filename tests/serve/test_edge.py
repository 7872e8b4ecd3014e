"""The edge of `serve --workers` and `serve --ray` (app/serve/edge.py) in front of a plain server on
loopback: what a client gets through it is what it gets from the server itself (records, verdict,
every refusal with its close code and reason, the health), the edge checking the clients' token
and reaching the server with a token of its own; a stopping edge drains (each client's records
of the audio it sent, its verdict, then 1001), or without time to drain closes its clients 1001
at once. (An upstream that dies, 1012 with a reason: tests/serve/test_serve_workers.py and
test_serve_ray.py.)"""
import json
import threading
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from app.serve.edge import Edge, Fixed
from app.serve.protocol import Limits
from app.serve.server import bind
from test_serve import HELLO, LIMITS, TOKEN, classify_jsonl, client, hops_of, refused, same, server, stream

CLIENTS_TOKEN = "the-clients-token-not-the-servers"


@pytest.fixture
def edge_of():
    """edge_of(url) -> the edge's URL in front of the server at ``url``: clients need
    CLIENTS_TOKEN at the edge, which reaches the server with the server's TOKEN."""
    def start(url):
        inner = url.split("/")[2]
        sock = bind("127.0.0.1", 0)
        Edge.start(Fixed([inner]), sock, LIMITS, 8, CLIENTS_TOKEN, TOKEN)
        return f"ws://127.0.0.1:{sock.getsockname()[1]}/v1/stream"
    yield start
    Edge.stop()


def test_through_the_edge_a_client_gets_what_the_server_gives(files, capsys, errors, edge_of):
    checkpoints, songs = files
    want = classify_jsonl(capsys, songs["a"], checkpoints)
    with server(checkpoints, capacity=1) as (url, app):
        front = edge_of(url)
        health = json.loads(urllib.request.urlopen(front.replace("ws://", "http://").replace("/v1/stream", "/v1/health"),
                                                   timeout=20).read())
        assert health["capacity"] == 1 and health["models"] == app.state.hub.health()["models"]
        assert health["servers"] == 1 and health["streams_by_server"] == [0]

        def refusals():
            for token in (None, "x" * 32, TOKEN):                   # the server's own token is no client's
                with pytest.raises(InvalidStatus) as e:
                    client(front, token)
                assert e.value.response.status_code == 403
            for first, then in (("{not json", ()), (json.dumps({**HELLO, "format": "f64le"}), ()),
                                (json.dumps({**HELLO, "format": "s16le"}), [b"\0\0\0"])):
                assert refused(front, first, then, CLIENTS_TOKEN) == refused(url, first, then)
            assert refused(front, json.dumps(HELLO), token=CLIENTS_TOKEN)[0] == 1013    # the one stream is taken
            assert refused(front, b"\0" * (Limits().message_bytes + 4), token=CLIENTS_TOKEN)[0] == 1009   # the edge's own limit

        records, verdict, code = stream(front, hops_of(songs["a"]), wait=refusals, token=CLIENTS_TOKEN)
        assert code == 1000 and verdict["hops"] == len(want)
        same(errors, records, want)


def test_a_stopping_edge_drains_each_client_gets_its_records_and_verdict_then_1001(files, capsys, errors, edge_of):
    """As a plain server's drain: the audio a client sent and the edge relayed is classified to
    its end (records equal classify's for it), then its verdict and a close 1001; a client
    arriving meanwhile gets 1001."""
    checkpoints, songs = files
    hops = hops_of(songs["a"])[:8]
    with server(checkpoints) as (url, _):
        front = edge_of(url)
        with client(front, CLIENTS_TOKEN) as ws:
            ws.send(json.dumps(HELLO))
            ws.recv(timeout=20)
            for hop in hops:
                ws.send(hop.astype("<f4").tobytes())
            first = json.loads(ws.recv(timeout=20))                             # a record: the stream runs
            app = Edge.running.app
            app.state.closing = True                  # as the drain begins (it ends too soon to race)
            with client(front, CLIENTS_TOKEN) as other:
                with pytest.raises(ConnectionClosed):
                    other.recv(timeout=20)
                late = (other.close_code, other.close_reason)
            app.state.closing = False
            stopper = threading.Thread(target=Edge.stop, kwargs={"drain_seconds": 20.0})
            stopper.start()
            messages = []
            with pytest.raises(ConnectionClosed):
                while True:
                    messages.append(json.loads(ws.recv(timeout=20)))
            stopper.join(timeout=30)
            assert (ws.close_code, ws.close_reason) == (1001, "the server is shutting down")
    records, verdict = [first] + messages[:-1], messages[-1]
    # the hops the edge had relayed when the drain began (all 8 unless the host is very slow)
    assert "verdict" in verdict and verdict["hops"] == len(records) and 1 < len(records) <= len(hops)
    assert late == (1001, "the server is shutting down")
    want = classify_jsonl(capsys, songs["a"], checkpoints)[:len(records)]
    same(errors, records, want)


def test_an_edge_stopped_without_a_drain_closes_its_clients_1001_at_once(files, edge_of):
    checkpoints, songs = files
    with server(checkpoints) as (url, _):
        front = edge_of(url)
        with client(front, CLIENTS_TOKEN) as ws:
            ws.send(json.dumps(HELLO))
            ws.recv(timeout=20)
            for hop in hops_of(songs["a"])[:4]:
                ws.send(hop.astype("<f4").tobytes())
            ws.recv(timeout=20)                                                # a record: the stream runs
            Edge.stop()
            with pytest.raises(ConnectionClosed):
                while True:
                    ws.recv(timeout=20)
            assert (ws.close_code, ws.close_reason) == (1001, "the server is shutting down")


def test_the_edge_spreads_streams_evenly_and_skips_a_dead_upstream():
    """Each new stream goes to the upstream holding the fewest of the edge's streams, an address
    that refuses connections (a replica gone, not yet replaced) is passed over, a stream that ends
    frees its place, and health sums the upstreams that answer. The replicas here are two small
    WebSocket apps that say which one they are."""
    import socket
    import time

    import uvicorn
    from fastapi import FastAPI, Response, WebSocket
    from websockets.sync.client import connect

    def replica(name):
        app = FastAPI()

        @app.websocket("/v1/stream")
        async def stream(ws: WebSocket):
            await ws.accept()
            await ws.send_text(name)
            while (await ws.receive())["type"] != "websocket.disconnect":
                pass

        @app.get("/v1/health")
        async def health():
            return Response(json.dumps({"replica": name, "active_streams": 0, "capacity": 1, "engine_hops": 0,
                                        "stream_hops": 0, "draining": False}), media_type="application/json")
        sock = bind("127.0.0.1", 0)
        srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
        return srv, f"127.0.0.1:{sock.getsockname()[1]}"

    dead = socket.socket()                   # a port nobody listens on
    dead.bind(("127.0.0.1", 0))
    gone = f"127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    (a, at), (b, bt) = replica("a"), replica("b")
    deadline = time.monotonic() + 30
    while not (a.started and b.started) and time.monotonic() < deadline:
        time.sleep(0.05)
    sock = bind("127.0.0.1", 0)
    Edge.start(Fixed([gone, at, bt], "replicas"), sock, LIMITS, 8)
    front = f"127.0.0.1:{sock.getsockname()[1]}"
    try:
        health = json.loads(urllib.request.urlopen(f"http://{front}/v1/health", timeout=20).read())
        assert (health["replicas"], health["capacity"], health["streams_by_replica"]) == (2, 2, [0, 0])
        clients = [connect(f"ws://{front}/v1/stream", proxy=None, open_timeout=20).__enter__() for _ in range(4)]
        names = [ws.recv(timeout=20) for ws in clients]
        assert sorted(names) == ["a", "a", "b", "b"], names
        assert Edge.running.app.state.load == {at: 2, bt: 2}
        clients[names.index("b")].close()
        deadline = time.monotonic() + 10
        while Edge.running.app.state.load.get(bt) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with connect(f"ws://{front}/v1/stream", proxy=None, open_timeout=20) as ws:
            assert ws.recv(timeout=20) == "b"                     # the replica with room
        for ws in clients:
            ws.close()
    finally:
        Edge.stop()
        a.should_exit = b.should_exit = True


def test_through_the_edge_a_posted_file_gets_what_classify_gives_and_the_page_loads(files, capsys, errors, edge_of):
    """POST /v1/classify at the edge: the file decoded there, streamed to the server within its
    credit; the verdict and records are classify's. The edge's page and access rules are the
    server's: the server's own token is no client's, another origin is refused."""
    from test_page import post, request, same_verdict
    checkpoints, songs = files
    want_records, want = classify_jsonl(capsys, songs["a"], checkpoints, verdict=True)
    with server(checkpoints, capacity=2) as (url, app):
        base = edge_of(url).replace("ws://", "http://").replace("/v1/stream", "")
        status, got = post(base, songs["a"], token=CLIENTS_TOKEN, records=True)
        assert status == 200, got
        same_verdict(errors, got, want, "through the edge")
        same(errors, got["records"], want_records)
        assert post(base, songs["a"], token=TOKEN)[0] == 401
        assert post(base, songs["a"], token=CLIENTS_TOKEN, headers={"Origin": "https://evil.example"})[0] == 403
        assert b'<button id="start"' in request(base + "/")[2]
        assert json.loads(request(base + "/v1/health")[2])["token_required"] is True
