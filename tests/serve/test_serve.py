"""`serve` and `listen` over real sockets on loopback (uvicorn in a thread, websockets clients):
results equal `classify FILE --jsonl`, several clients join and leave, every refusal has its
close code while a witness client's results stay those of classify, and a non-loopback host needs
a token. (SIGTERM draining runs the real command: tests/serve/test_serve_process.py.)"""
import json
import socket
from dataclasses import replace
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import uvicorn
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from app.cli import main
from app.runtime.frontend_args import FrontEndSpec
from app.serve.protocol import Limits
from app.serve.server import bind, uvicorn_config
from app.serve.service import build_app
from app.serve.spec import HubSpec
from audio.sources import FileSource

TOKEN = "a-test-token-of-32-characters-ok"
HELLO = {"sample_rate": 16000, "channels": 1, "format": "f32le"}
# As tests/app/test_streams.py PROB_TOL (the same tiny models, the same front end): the server's
# engine's many streams against the same engine running each source alone.
PROB_TOL = 6e-6


# every test client is on 127.0.0.1: no cap per address unless a test sets one
LIMITS = Limits(outbox_seconds=1.0, burst_seconds=2.0, streams_per_address=0)


@contextmanager
def server(checkpoints, *, capacity=3, limits=LIMITS, token=TOKEN, origins=(), tls=None, **spec_options):
    """The app of `serve` on a free loopback port in a thread (``tls``: uvicorn's ssl_certfile and
    ssl_keyfile): (the stream's URL, ws or wss, and the app)."""
    spec = HubSpec(FrontEndSpec("musicnn"), capacity, tuple(checkpoints), None, {}, limits, **spec_options)
    app = build_app(spec.build, token=token, limits=limits, origins=origins)
    sock = bind("127.0.0.1", 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)   # accepted sockets inherit it
    srv = uvicorn.Server(uvicorn_config(app, limits, 2 * capacity, **(tls or {})))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    try:
        yield f"{'wss' if tls else 'ws'}://127.0.0.1:{sock.getsockname()[1]}/v1/stream", app
    finally:
        srv.should_exit = True
        thread.join(timeout=20)


def client(url, token=TOKEN, **kw):
    return connect(url, additional_headers={"Authorization": f"Bearer {token}"} if token else None,
                   proxy=None, open_timeout=20, **kw)


def hops_of(path) -> list[np.ndarray]:
    return list(FileSource(path))


def stream(url, hops, *, wait=None, joined=None, token=TOKEN) -> tuple[list[dict], dict, int]:
    """Send a file's hops and end (``joined()`` runs once the server has answered the hello,
    before any audio; ``wait()`` after the second hop, the sending paused), reading all the
    while: (records, verdict, close code)."""
    records, verdict = [], None
    with client(url, token) as ws:
        ws.send(json.dumps(HELLO))
        assert set(json.loads(ws.recv(timeout=20))) == {"classes", "models", "credit_seconds"}
        if joined is not None:
            joined()

        def send():
            for i, hop in enumerate(hops):
                ws.send(hop.astype("<f4").tobytes())
                if wait is not None and i == 1:
                    wait()
            ws.send(json.dumps({"end": True}))
        sender = threading.Thread(target=send)
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
        sender.join(timeout=120)
        return records, verdict, ws.close_code


def repeated(option: str, values) -> list[str]:
    """A repeatable option once per value: --checkpoint a --checkpoint b."""
    return [x for v in values for x in (option, str(v))]


def records_and_verdict(text: str) -> tuple[list[dict], dict]:
    """JSON lines of a stream: its records, then its one verdict record last."""
    lines = [json.loads(x) for x in text.splitlines()]
    assert "verdict" in lines[-1] and not any("verdict" in x for x in lines[:-1])
    return lines[:-1], lines[-1]


def classify_jsonl(capsys, path, checkpoints, verdict: bool = False):
    """`classify FILE --jsonl`'s records (and, if asked, its verdict record)."""
    assert main(["classify", str(path), "--jsonl", *repeated("--checkpoint", checkpoints)]) == 0
    records, last = records_and_verdict(capsys.readouterr().out)
    return (records, last) if verdict else records


def same(errors, got: list[dict], want: list[dict]) -> None:
    assert [(r["step"], r["audio_time"]) for r in got] == [(r["step"], r["audio_time"]) for r in want]
    worst = 0.0
    for g, w in zip(got, want):
        assert list(g["models"]) == list(w["models"])
        for name, m in g["models"].items():
            worst = max(worst, max(abs(a - b) for a, b in zip(m["probabilities"], w["models"][name]["probabilities"])))
            assert m["top"][0] == w["models"][name]["top"][0] or abs(m["top"][1] - w["models"][name]["top"][1]) < 1e-5
    errors("served vs classify FILE --jsonl (probabilities)", worst, PROB_TOL)


@pytest.mark.parametrize("shards", [1, 2])
def test_two_clients_joining_at_different_times_each_get_what_classify_gives(files, capsys, errors, monkeypatch, shards):
    """With 2 shards (as on a 2-core CPU) each client in its own."""
    from app.serve import hub as hub_module
    monkeypatch.setattr(hub_module, "default_shards", lambda device, capacity: shards)
    checkpoints, songs = files
    want = {k: classify_jsonl(capsys, p, checkpoints) for k, p in songs.items()}
    with server(checkpoints) as (url, app):
        assert len(app.state.hub.engine.shards) == shards
        got = {}
        second = threading.Thread(target=lambda: got.__setitem__("b", stream(url, hops_of(songs["b"]))))
        got["a"] = stream(url, hops_of(songs["a"]), wait=second.start)    # b joins after a's second hop
        second.join(timeout=60)
        for k in songs:
            records, verdict, code = got[k]
            assert code == 1000 and verdict["hops"] == len(want[k])
            same(errors, records, want[k])
            assert {n: v["steps"] for n, v in verdict["verdict"].items()} == {n: len(want[k]) for n in want[k][0]["models"]}
        health = app.state.hub.health()
        assert health["active_streams"] == 0
        assert health["stream_hops"] == sum(len(want[k]) for k in songs)             # a record a stream-hop
        assert sum(len(want[k]) for k in songs) / 2 <= health["engine_hops"] <= health["stream_hops"]


def test_a_lane_held_up_delays_only_its_own_streams(files, capsys, errors, monkeypatch):
    """Two lanes (as on a 2-core CPU), the first client's held in its hop: the second client,
    in the other lane, gets all of classify's records and its verdict meanwhile; then the first
    gets its own. Clients joining at once are spread over the lanes."""
    from app.runtime.shard import StreamsShard
    from app.serve import hub as hub_module
    monkeypatch.setattr(hub_module, "default_shards", lambda device, capacity: 2)
    checkpoints, songs = files
    want = {k: classify_jsonl(capsys, p, checkpoints) for k, p in songs.items()}
    release, held = threading.Event(), threading.Event()
    hop = StreamsShard.hop

    def held_hop(shard):
        if shard is shards[0] and shard.streams:
            held.set()
            release.wait(60)
        return hop(shard)
    monkeypatch.setattr(StreamsShard, "hop", held_hop)
    with server(checkpoints, capacity=4) as (url, app):
        hub = app.state.hub
        shards = hub.engine.shards
        got = {}
        first = threading.Thread(target=lambda: got.__setitem__("a", stream(url, hops_of(songs["a"]))))
        first.start()
        assert held.wait(60)                                     # a's lane is inside its hop
        got["b"] = stream(url, hops_of(songs["b"]))               # b: the other lane, start to end
        a_meanwhile = hub.connections["ws:0"].source.stats.hops
        release.set()
        first.join(timeout=60)
        assert hub.load == [0, 0]
        for k in songs:
            records, verdict, code = got[k]
            assert code == 1000 and verdict["hops"] == len(want[k])
            same(errors, records, want[k])
        assert a_meanwhile == 0                                  # held in its first hop
        # four clients at once, each sending its audio once all four have joined: two in each
        # lane (the lanes' joins run on their own threads)
        placed = []
        everyone = threading.Barrier(4, timeout=60, action=lambda: placed.extend(
            c.stream.shard for c in hub.connections.values()))
        together = [threading.Thread(target=stream, args=(url, hops_of(songs["b"])), kwargs={"joined": everyone.wait})
                    for _ in range(4)]
        for t in together:
            t.start()
        for t in together:
            t.join(timeout=60)
        assert sorted(placed) == [0, 0, 1, 1]


def test_listen_prints_what_classify_prints(files, capsys, errors):
    checkpoints, songs = files
    want, verdict = classify_jsonl(capsys, songs["a"], checkpoints, verdict=True)
    with server(checkpoints) as (url, _):
        token = songs["a"].parent / "token"
        token.write_text(TOKEN + "\n")
        assert main(["listen", url, str(songs["a"]), "--pace", "fast", "--jsonl", "--token-file", str(token)]) == 0
        out = capsys.readouterr()
        records, served = records_and_verdict(out.out)     # the server's verdict passed through as data
        same(errors, records, want)
        assert "# verdict over ws:" in out.err
        # the same verdict as classify's: each record's probabilities within PROB_TOL, so each
        # mean probability too; a top can swap only in a near tie (`same`), one hop of the share
        assert served["hops"] == verdict["hops"] == len(want) and list(served["verdict"]) == list(verdict["verdict"])
        for name, v in verdict["verdict"].items():
            s = served["verdict"][name]
            assert s["genre"] == v["genre"] and s["steps"] == v["steps"]
            assert abs(s["share"] - v["share"]) <= 1 / v["steps"] and abs(s["confidence"] - v["confidence"]) <= PROB_TOL
        assert main(["listen", url, str(songs["a"]), "--pace", "fast"]) == 1               # no token
        assert "error: the server refused the connection: HTTP 403 (a missing or wrong token)" in capsys.readouterr().err


def test_a_checkpoint_of_its_own_classes_is_served_with_their_names(files, capsys, errors, tmp_path):
    """A model trained on a user's own classes (`extract --folders`) beside a GTZAN one: each
    record and the verdict name the model's own classes, and equal classify's."""
    from audio.frontends import build_frontend, frontend_metadata
    from app.checkpoint import save_checkpoint
    from tiny import tiny_model
    classes = ["hum", "rain", "whistle"]
    own = tmp_path / "own.pt"
    save_checkpoint(tiny_model("continual", n=8, in_dim=50, num_classes=3, seed=5), own, classes=classes,
                    frontend=frontend_metadata(build_frontend("musicnn")))
    checkpoints, songs = files
    lineup = [checkpoints[0], str(own)]
    want, verdict = classify_jsonl(capsys, songs["b"], lineup, verdict=True)
    with server(lineup) as (url, _):
        token = tmp_path / "token"
        token.write_text(TOKEN + "\n")
        assert main(["listen", url, str(songs["b"]), "--pace", "fast", "--jsonl", "--token-file", str(token)]) == 0
        records, served = records_and_verdict(capsys.readouterr().out)
    same(errors, records, want)
    gtzan, name = list(want[0]["models"])           # classify's names, one per checkpoint in order
    assert {tuple(r["models"][name]["classes"]) for r in records} == {tuple(classes)}
    assert {len(r["models"][gtzan]["classes"]) for r in records} == {10}
    assert {r["models"][name]["top"][0] for r in records} <= set(classes)
    assert served["verdict"][name]["genre"] == verdict["verdict"][name]["genre"] and verdict["verdict"][name]["genre"] in classes


def test_listen_resumes_a_dropped_stream_as_a_fresh_one(files, capsys, monkeypatch):
    """The server fails the first connection after two hops (a server error, 1011): listen says
    so in one line, reconnects and sends the rest of the file as a fresh stream, to its verdict,
    starting from the first hop whose record had not come back: every hop of the file is
    classified once, however much audio was in flight when the first connection broke."""
    checkpoints, songs = files
    with server(checkpoints) as (url, app):
        hub, fed = app.state.hub, []
        feed = hub.feed

        def failing(conn, data):
            fed.append(conn)
            if len(fed) == 3:
                raise RuntimeError("a fault injected into the first connection")
            feed(conn, data)
        monkeypatch.setattr(hub, "feed", failing)
        token = songs["a"].parent / "token"
        token.write_text(TOKEN + "\n")
        assert main(["listen", url, str(songs["a"]), "--pace", "fast", "--jsonl", "--token-file", str(token)]) == 0
        out = capsys.readouterr()
    steps = [json.loads(x)["step"] for x in out.out.splitlines() if '"verdict"' not in x]
    starts = [i for i, step in enumerate(steps) if step == 0]        # each stream's records from step 0
    assert 1 <= len(starts) <= 2 and all(steps[i:j] == list(range(j - i)) for i, j in zip(starts, starts[1:] + [len(steps)]))
    assert len(steps) == len(hops_of(songs["a"]))
    assert "reconnecting: a fresh stream from there" in out.err and out.err.count("# verdict over ws:") == 1
    assert len({id(c) for c in fed}) == 2                                       # two connections


def test_listen_waits_for_a_full_server(files, capsys, monkeypatch):
    """A server with one stream, held by another client for 3 s: listen hears 1013, says so in one
    line, asks again after the wait the reason names and streams to its verdict once the slot is
    free."""
    import app.serve.client as client_module
    monkeypatch.setattr(client_module, "FULL_TRIES", 60)                   # 30 s: slow hosts too
    checkpoints, songs = files
    with server(checkpoints, capacity=1, limits=replace(LIMITS, retry_seconds=0.5)) as (url, app):
        with client(url) as holder:
            holder.send(json.dumps(HELLO))
            holder.recv(timeout=20)
            threading.Timer(3.0, holder.close).start()              # frees the slot in 3 s
            token = songs["a"].parent / "token"
            token.write_text(TOKEN + "\n")
            assert main(["listen", url, str(songs["a"]), "--pace", "fast", "--jsonl", "--token-file", str(token)]) == 0
    out = capsys.readouterr()
    assert "# the server is full (1013: the server is full (1 streams); retry in 0.5 s); asking again in 0.5 s" in out.err
    assert "# verdict over ws:" in out.err and records_and_verdict(out.out)[0][0]["step"] == 0


def test_a_flooding_client_is_read_at_the_rate_limit(files):
    """Limits(speed=1, burst 1 s): a client sending audio as fast as it can is read at most one
    second plus real time (plus the message in hand); the rest waits in its own socket."""
    checkpoints, _ = files
    limits = Limits(outbox_seconds=2.0, burst_seconds=1.0, speed=1.0)
    with server(checkpoints, limits=limits) as (url, app):
        with client(url, close_timeout=0.5) as ws:    # its close waits behind the unread flood: not for long
            # the clock starts before the hello, so before the server's reading starts (after
            # it): the server's own elapsed time is at most the test's, whatever either waits for
            start, stop = time.monotonic(), threading.Event()
            ws.send(json.dumps(HELLO))
            ws.recv(timeout=20)

            def flood():
                hop = np.full(4000, 0.1, "<f4").tobytes()
                try:
                    while not stop.is_set():
                        ws.send(hop)
                except (ConnectionClosed, OSError):
                    pass

            def drain():
                try:
                    while True:
                        ws.recv(timeout=30)
                except (ConnectionClosed, TimeoutError):
                    pass
            threads = [threading.Thread(target=f, daemon=True) for f in (flood, drain)]
            for t in threads:
                t.start()
            read = []
            while time.monotonic() - start < 3.0:
                time.sleep(0.1)
                conn = next(iter(app.state.hub.connections.values()), None)
                if conn is not None:
                    read.append((conn.source.decoder.seconds, time.monotonic() - start))
            stop.set()
    assert read and max(r for r, _ in read) >= 1.0                              # the burst is read
    assert all(r <= 1.0 + t + 0.25 for r, t in read), read                       # then real time


def refused(url, first, then=(), token=TOKEN, **kw) -> tuple[int, str]:
    """A client that sends ``first`` then ``then``: the server's close code and reason."""
    with client(url, token, **kw) as ws:
        ws.send(first)
        try:
            for m in then:
                ws.send(m)
            while True:
                ws.recv(timeout=20)
        except ConnectionClosed:
            pass
        return ws.close_code, ws.close_reason


def test_faulty_clients_are_refused_with_their_codes_and_a_witness_is_unaffected(files, capsys, errors):
    checkpoints, songs = files
    want = classify_jsonl(capsys, songs["a"], checkpoints)
    hello = json.dumps(HELLO)
    with server(checkpoints, capacity=8) as (url, app):      # a refused stream's slot is free at the next hop
        witness = {}

        def faults():
            for token in (None, "x" * 32):
                with pytest.raises(InvalidStatus) as e:
                    client(url, token)
                assert e.value.response.status_code == 403
            assert refused(url, "{not json")[0] == 1007
            assert refused(url, json.dumps({**HELLO, "format": "f64le"}))[0] == 1003
            assert refused(url, json.dumps({**HELLO, "sample_rate": 10 ** 9}))[0] == 1007
            code, reason = refused(url, json.dumps({**HELLO, "format": "s16le"}), [b"\0\0\0"])
            assert code == 1007 and "not whole s16le frames" in reason
            assert refused(url, hello, [np.array([0.1, np.nan], "<f4").tobytes()]) == (1007, "the audio holds NaN or infinite samples")
            assert refused(url, hello, [b"\0" * (Limits().message_bytes + 4)])[0] == 1009
            # only JSON true ends a stream; any other "end" is 1007, any other text 1003; a wrongly
            # typed hello field is 1007 or 1003, never a server error
            for end in ('{"end": false}', '{"end": 1}', '{"end": "true"}', '{"end": true, "x": 1}'):
                assert refused(url, hello, [end])[0] == 1007, end
            assert refused(url, hello, ['{"stop": true}'])[0] == 1003
            for fmt in (["f32le"], {"f32le": 1}, 1, None):
                assert refused(url, json.dumps({**HELLO, "format": fmt}))[0] == 1003, fmt
            for rate in (16000.0, "16000", True, [16000]):
                assert refused(url, json.dumps({**HELLO, "sample_rate": rate}))[0] == 1007, rate
            # a client that leaves mid-stream: its slot is free at the next hop
            with client(url) as ws:
                ws.send(hello)
                ws.recv(timeout=20)
                ws.send(np.zeros(8000, "<f4").tobytes())

        witness_thread = threading.Thread(target=lambda: witness.setdefault("r", stream(url, hops_of(songs["a"]), wait=faults)))
        witness_thread.start()
        witness_thread.join(timeout=240)
        records, verdict, code = witness["r"]
        assert code == 1000
        same(errors, records, want)
        deadline = time.monotonic() + 10
        while app.state.hub.health()["active_streams"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.hub.health()["active_streams"] == 0


def test_a_client_that_never_reads_leaves_the_engine(files):
    """Its outbox fills (small socket buffers, no compression), its stream leaves the engine and
    its slot is free; the close frame it never reads is its own problem."""
    checkpoints, _ = files
    with server(checkpoints) as (url, app):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", int(url.split(":")[2].split("/")[0])))
        ws = client(url, sock=s, max_queue=1, compression=None, close_timeout=1).__enter__()
        ws.send(json.dumps(HELLO))

        def flood():
            chunk = np.full(16000, 0.1, "<f4").tobytes()
            try:
                while True:
                    ws.send(chunk)
            except (ConnectionClosed, OSError):
                pass
        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        hub, deadline = app.state.hub, time.monotonic() + 60
        while not hub.connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hub.connections
        while hub.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not hub.connections and hub.engine.streams == []
        s.shutdown(socket.SHUT_RDWR)
        sender.join(timeout=10)


def test_a_full_server_answers_1013_and_a_silent_client_is_closed(files):
    checkpoints, _ = files
    with server(checkpoints, capacity=1, limits=Limits(idle_seconds=3.0)) as (url, app):
        with client(url) as first:
            first.send(json.dumps(HELLO))
            first.recv(timeout=20)
            assert refused(url, json.dumps(HELLO))[0] == 1013
            with pytest.raises(ConnectionClosed):
                first.recv(timeout=20)                       # it sent nothing for 3 s
            assert (first.close_code, first.close_reason) == (1008, "no message for 3 s; closed")


def test_a_host_beyond_loopback_needs_a_token(monkeypatch):
    """Refused before anything is bound (a documentation-range address, and bind forbidden)."""
    import app.serve.server as server_module

    def no_bind(*args):
        raise AssertionError("serve bound a socket before refusing")
    monkeypatch.setattr(server_module, "bind", no_bind)
    with pytest.raises(SystemExit, match="reachable from other machines: give --token-file"):
        main(["serve", "--host", "192.0.2.1"])


def test_a_hop_waits_for_the_other_streams_at_most_the_batch_delay():
    """Hub.batch_wait on real sources: none with a hop -> no hop; every stream with one (or one
    ended) -> at once; else the oldest waiting hop's remaining batch delay (100 s here, so that no
    pause of the host can use it up between two looks)."""
    from types import SimpleNamespace

    from app.serve.hub import Hub, NetworkSource
    from app.serve.protocol import Hello, PcmDecoder
    from audio.melspec import HOP

    BATCH_DELAY_S = 100.0

    def source(name):
        return NetworkSource(name, PcmDecoder(Hello(16000, 1, "f32le")))
    a, b = source("a"), source("b")
    hub = SimpleNamespace(connections={"a": SimpleNamespace(source=a), "b": SimpleNamespace(source=b)},
                          batch_delay=BATCH_DELAY_S)
    assert Hub.batch_wait(hub) is None
    hop = np.zeros(HOP, np.float32).tobytes()
    before = time.monotonic()
    a.push(a.decoder.feed(hop))
    wait = Hub.batch_wait(hub)
    assert 0 < wait <= BATCH_DELAY_S and wait >= BATCH_DELAY_S - (time.monotonic() - before)
    b.push(b.decoder.feed(hop[:len(hop) // 2]))                   # half a hop: not yet
    assert 0 < Hub.batch_wait(hub) <= wait
    b.push(b.decoder.feed(hop[len(hop) // 2:]))
    assert Hub.batch_wait(hub) == 0.0
    assert next(a) is not None and next(b) is not None and next(a) is None
    assert Hub.batch_wait(hub) is None
    b.close()
    assert Hub.batch_wait(hub) == 0.0                             # its stream leaves at the next hop
    with pytest.raises(StopIteration):
        next(b)


def test_the_batch_delay_steps_clients_with_different_phases_together(files, monkeypatch):
    """One lane, two clients streaming in real time, the second's hops 125 ms after the first's:
    with `--batch-delay-ms 240` a lane's hop waits for the other client's hop and takes both (about
    half as many engine hops as records: 16 or 17 for 32, the last hops alone once the first
    client has ended; a pair split only where the second client's hop comes 115 ms late, and the
    bound allows three); at 0 each hop is stepped when it is whole (32: a pair merges only where a
    hop is 125 ms late). Every hop gets its record either way."""
    from app.serve import hub as hub_module
    monkeypatch.setattr(hub_module, "default_shards", lambda device, capacity: 1)
    checkpoints, _ = files
    hops = 16

    def paced(url, start, got):
        with client(url) as ws:
            ws.send(json.dumps(HELLO))
            ws.recv(timeout=20)
            for i in range(hops):                    # on an absolute schedule: no drift between clients
                time.sleep(max(0.0, start + 0.25 * i - time.monotonic()))
                ws.send(np.full(4000, 0.05 * (i + 1), "<f4").tobytes())
            ws.send(json.dumps({"end": True}))
            got.append(sum("step" in json.loads(text) for text in ws))

    counts = {}
    for delay in (240.0, 0.0):
        with server(checkpoints, batch_delay_ms=delay) as (url, app):
            got, start = [], time.monotonic() + 1.0
            clients = [threading.Thread(target=paced, args=(url, start + offset, got)) for offset in (0.0, 0.125)]
            for t in clients:
                t.start()
            for t in clients:
                t.join(timeout=60)
            assert got == [hops, hops]
            health = app.state.hub.health()
            assert health["stream_hops"] == 2 * hops
            counts[delay] = health["engine_hops"]
    assert counts[240.0] <= 0.6 * 2 * hops < counts[0.0], counts
