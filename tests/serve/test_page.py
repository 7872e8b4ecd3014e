"""`serve` for browsers and other programs over HTTP: the page at `/` in a real headless Chromium
with a fake microphone playing a real GTZAN excerpt (its records' top genre is `classify`'s on
that excerpt), `POST /v1/classify` equal to `classify FILE --jsonl` over http and https, the
token as a WebSocket subprotocol, and every refusal (another origin, another host name, no
token, a body over the cap before it is read, a body that is not audio) while a live client's
records stay `classify`'s."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from app.serve.access import bearer_subprotocol
from audio_helpers import write
from doc_example import example
from test_serve import HELLO, LIMITS, TOKEN, classify_jsonl, hops_of, records_and_verdict, same, server, stream

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@contextmanager
def serving(checkpoints, **options):
    """``test_serve.server``'s app: its base URL (http or https)."""
    with server(checkpoints, **options) as (url, _):
        yield url.replace("ws", "http", 1).removesuffix("/v1/stream")


def request(url, *, method="GET", body=None, headers=None, context=None):
    """(status, headers, body bytes) of one HTTP request, errors included."""
    r = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(r, timeout=120) as answer:
            return answer.status, answer.headers, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def post(base, path, *, token=TOKEN, records=False, context=None, headers=None):
    """POST a file's bytes to /v1/classify: (status, JSON answer)."""
    h = {"Authorization": f"Bearer {token}"} if token else {}
    status, _, body = request(f"{base}/v1/classify{'?records=1' if records else ''}", method="POST",
                              body=Path(path).read_bytes(), headers={**h, **(headers or {})}, context=context)
    return status, json.loads(body)


def same_verdict(errors, got: dict, want: dict, label: str) -> None:
    """Two verdict records of the same audio: the same genres, shares, steps and top classes;
    mean probabilities within the records' tolerance (a mean of float32-rounded probabilities)."""
    from test_serve import PROB_TOL
    assert got["hops"] == want["hops"] and got["error"] == want["error"]
    assert set(got["verdict"]) == set(want["verdict"])
    worst = 0.0
    for name, v in got["verdict"].items():
        w = want["verdict"][name]
        assert (v["genre"], v["share"], v["steps"]) == (w["genre"], w["share"], w["steps"]), name
        assert [c for c, _ in v["top"]] == [c for c, _ in w["top"]] or max(
            abs(a[1] - b[1]) for a, b in zip(v["top"], w["top"])) < 1e-5
        worst = max(worst, abs(v["confidence"] - w["confidence"]), *(abs(a[1] - b[1]) for a, b in zip(v["top"], w["top"])))
    errors(f"POST /v1/classify vs classify FILE --jsonl ({label})", worst, PROB_TOL)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and localhost, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate for the https case")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def test_the_page_its_files_and_the_api_description_are_served_from_the_package(files):
    checkpoints, _ = files
    with serving(checkpoints) as base:
        status, headers, body = request(base + "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert b'<button id="start" type="button">Start</button>' in body
        assert "default-src 'self'" in headers["content-security-policy"] and "frame-ancestors 'none'" in headers[
            "content-security-policy"]
        for name in ("page.js", "worklet.js", "page.css", "docs.js"):
            status, headers, body = request(f"{base}/static/{name}")
            assert status == 200 and len(body) > 200, name
        assert request(base + "/docs")[0] == 200
        spec = json.loads(request(base + "/openapi.json")[2])
        assert set(spec["paths"]) == {"/v1/health", "/v1/classify"}
        upload = spec["paths"]["/v1/classify"]["post"]
        assert {"200", "401", "403", "413", "415", "422", "503"} <= set(upload["responses"])
        assert "/v1/stream" in spec["info"]["description"]
        health = json.loads(request(base + "/v1/health")[2])
        assert health["token_required"] is True and health["limits"]["upload_bytes"] == LIMITS.upload_bytes
        assert request(base + "/static/../service.py")[0] == 404


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_posted_file_gets_the_verdict_classify_gives(files, capsys, errors, certificate, scheme):
    """The verdict record of `classify FILE --jsonl` (and with ?records=1 its hop records) for
    the file's bytes posted, over http and over https with a self-signed certificate."""
    import ssl
    checkpoints, songs = files
    tls, context = None, None
    if scheme == "https":
        cert, key = certificate
        tls = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
        context = ssl.create_default_context(cafile=str(cert))
    with serving(checkpoints, tls=tls) as base:
        for name, path in songs.items():
            want_records, want = classify_jsonl(capsys, path, checkpoints, verdict=True)
            status, got = post(base, path, records=name == "a", context=context)
            assert status == 200, got
            assert got["source"].startswith("upload:")
            same_verdict(errors, got, want, f"{scheme}, {name}")
            if name == "a":
                same(errors, got["records"], want_records)


def test_the_token_travels_as_a_subprotocol_and_is_never_echoed(files):
    checkpoints, songs = files
    with serving(checkpoints) as base:
        url = base.replace("http", "ws") + "/v1/stream"
        with connect(url, subprotocols=["nystream", bearer_subprotocol(TOKEN)], proxy=None, open_timeout=20) as ws:
            assert ws.subprotocol == "nystream"
            assert TOKEN not in str(ws.response.headers)
            ws.send(json.dumps(HELLO))
            assert "classes" in json.loads(ws.recv(timeout=20))
        for offered in (["nystream", bearer_subprotocol("another-token-of-32-characters-no")], ["nystream"]):
            with pytest.raises(InvalidStatus) as refused:
                connect(url, subprotocols=offered, proxy=None, open_timeout=20)
            assert refused.value.response.status_code == 403


def raw_upgrade(base: str, headers: dict) -> bytes:
    """The answer's first bytes to a WebSocket upgrade with the token and ``headers`` (its Host
    replaces the URL's)."""
    host, port = base.split("//")[1].split(":")
    lines = {"Host": f"{host}:{port}", "Upgrade": "websocket", "Connection": "Upgrade",
             "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13",
             "Authorization": f"Bearer {TOKEN}", **headers}
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(("GET /v1/stream HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in lines.items()) + "\r\n").encode())
        return s.recv(4096)


def raw_post(base: str, declared: int, sent: bytes) -> tuple[bytes, float]:
    """A POST declaring ``declared`` body bytes of which only ``sent`` go out: the answer's first
    bytes and how long it took."""
    host, port = base.split("//")[1].split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(f"POST /v1/classify HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
                  f"Content-Length: {declared}\r\n\r\n".encode() + sent)
        return s.recv(4096), time.monotonic() - t0


def test_every_refusal_while_a_live_client_streams_unharmed(files, capsys, errors, tmp_path):
    """Another origin (upgrade and POST), another host name (DNS rebinding), no token, 200 MB
    declared, bytes that are not audio, an empty body, an absurd header: each refused with its
    status and a one-line JSON reason, while a client streams a file whose records stay
    `classify`'s; an origin given with --allow-origin passes."""
    import soundfile
    checkpoints, songs = files
    samples, rate = soundfile.read(songs["b"], dtype="float32")
    long = write(tmp_path / "long.wav", np.tile(samples, 15), rate)      # 30 s, read at 4x real time
    want = classify_jsonl(capsys, long, checkpoints)
    allowed = "https://app.example.org"
    with serving(checkpoints, origins=(allowed,)) as base:
        url = base.replace("http", "ws") + "/v1/stream"
        witness = {}
        live = threading.Thread(target=lambda: witness.setdefault("got", stream(url, hops_of(long))))
        live.start()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"}, {"Host": "evil.example:80"}):
            assert raw_upgrade(base, headers).startswith(b"HTTP/1.1 403 "), headers
            status, answer = post(base, songs["a"], headers=headers)
            assert status == 403 and "\n" not in answer["error"], (headers, answer)
        with connect(url, additional_headers={**auth, "Origin": allowed}, proxy=None, open_timeout=20) as ws:
            ws.send(json.dumps(HELLO))
            assert "classes" in json.loads(ws.recv(timeout=20))
        own = base.replace("127.0.0.1", "localhost")
        assert post(base, songs["a"], headers={"Origin": own, "Host": own.split("//")[1]})[0] == 200
        status, answer = post(base, songs["a"], token=None)
        assert status == 401 and "token" in answer["error"]
        assert post(base, songs["a"], token="another-token-of-32-characters-no")[0] == 401
        answer, seconds = raw_post(base, 200 * 2**20, b"RIFF" + b"\0" * 4096)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"max-upload-mb" in answer and seconds < 10
        for name, body, code, says in (("garbage.bin", os.urandom(50_000), 415, "cannot decode"),
                                       ("empty.wav", b"", 400, "empty"),
                                       ("absurd.wav", absurd_wav(), 422, "declares")):
            (tmp_path / name).write_bytes(body)
            status, answer = post(base, tmp_path / name)
            assert status == code and says in answer["error"] and "\n" not in answer["error"], (name, answer)
            assert "nystream-upload" not in answer["error"]              # no server path in a reason
        live.join(timeout=120)
        records, verdict, code = witness["got"]
        assert code == 1000 and verdict["hops"] == len(want)
        same(errors, records, want)
        health = json.loads(request(base + "/v1/health")[2])
        assert health["active_streams"] == 0 and not health["draining"]
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("nystream-upload-*"))


def test_a_body_over_the_cap_without_a_length_is_refused_once_it_passes(files):
    """A chunked body (no Content-Length) is read until it passes the cap, then refused 413."""
    from dataclasses import replace
    checkpoints, _ = files
    with serving(checkpoints, limits=replace(LIMITS, upload_bytes=64 * 1024)) as base:
        host, port = base.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(f"POST /v1/classify HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
                      f"Transfer-Encoding: chunked\r\n\r\n".encode())
            chunk = b"\0" * 16384
            for _ in range(5):
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413 ")


def absurd_wav() -> bytes:
    """A WAV header declaring 90 channels."""
    import struct
    fmt = struct.pack("<HHIIHH", 1, 90, 16000, 16000 * 180, 180, 16)
    data = b"\0" * 1800
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt " +
            struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


@pytest.mark.parametrize("argv,says", [
    (["--allow-origin", "example.org"], "serve: --allow-origin 'example.org': give an origin as a browser sends it"),
    (["--allow-origin", "https://example.org/app"], "serve: --allow-origin 'https://example.org/app': give an origin"),
    (["--ssl-certfile", "cert.pem"], "serve: give --ssl-certfile and --ssl-keyfile together"),
    (["--ssl-certfile", "missing.pem", "--ssl-keyfile", "missing.pem"],
     "serve: the certificate missing.pem with the key missing.pem cannot be used: No such file or directory"),
])
def test_options_that_cannot_work_are_one_line_before_any_model_loads(argv, says):
    from app.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", *argv])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


LIGHT = """import builtins, runpy, sys
_real = builtins.__import__
def _light(name, *args, **kw):
    if name.split(".")[0] in {"torch", "PySide6", "pyqtgraph", "sklearn", "numba", "librosa", "onnxruntime",
                              "onnx", "matplotlib", "ray"}:
        raise ImportError(f"{name} is not installed for this client")
    return _real(name, *args, **kw)
builtins.__import__ = _light
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_listen_and_the_python_example_run_where_torch_and_qt_are_not(files, capsys, errors, tmp_path):
    """A client without torch, Qt, numba, librosa or scikit-learn (every import of them fails):
    `listen FILE --jsonl` gets what `classify FILE --jsonl` gives, and docs/serve.md's example
    prints a verdict."""
    checkpoints, songs = files
    want_records, want = classify_jsonl(capsys, songs["a"], checkpoints, verdict=True)
    (tmp_path / "light.py").write_text(LIGHT)
    (tmp_path / "example.py").write_text(example("serve.md"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with serving(checkpoints, token=None) as base:
        url = base.replace("http", "ws") + "/v1/stream"
        r = subprocess.run([sys.executable, "light.py", str(ROOT / "main.py"), "listen", url, str(songs["a"]),
                            "--pace", "fast", "--jsonl"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        records, verdict = records_and_verdict(r.stdout)
        same(errors, records, want_records)
        same_verdict(errors, verdict, want, "listen without torch")
        r = subprocess.run([sys.executable, "light.py", "example.py", url, str(songs["a"])], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.splitlines()[-1] == str({m: v["genre"] for m, v in want["verdict"].items()})


# ---------------------------------------------------------------------------- a real browser

EXCERPT = "classical.00000.wav"         # the shipped model's verdict on it: classical on 100 % of the steps


@pytest.mark.browser
@pytest.mark.shared
def test_the_page_streams_a_microphone_in_chromium_and_shows_classifys_genre(tmp_path, capsys):
    """Headless Chromium, its fake microphone playing a GTZAN excerpt: the page's Start streams
    it, the page's WebSocket receives records whose most frequent top genre is `classify`'s
    verdict on that excerpt, the page shows it, Stop brings the verdict; the excerpt chosen as a
    file shows classify's verdict; /docs draws the API; a screenshot is kept."""
    if CHROMIUM is None:
        pytest.skip("no Chromium here (Debian: apt-get install chromium; make test installs it)")
    playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (the dev extra)")
    excerpt = SHARED / "gtzan_excerpts" / EXCERPT
    if not excerpt.is_file():
        pytest.skip("../shared/data is absent")
    from app.cli import main
    from app.runtime.lineup import best_shipped, load_trained, shipped_checkpoints
    best = best_shipped([load_trained(p, "musicnn", "cpu") for p in shipped_checkpoints("musicnn")])
    assert main(["classify", str(excerpt), "--jsonl", "-q"]) == 0
    want = json.loads(capsys.readouterr().out.splitlines()[-1])["verdict"][best.name]
    assert want["share"] >= 0.9                   # a clear answer: a live stream of any 10 s of it agrees
    with serving([best.path], capacity=2) as base, playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
            f"--use-file-for-fake-audio-capture={excerpt}"])
        try:
            page = browser.new_page(viewport={"width": 412, "height": 915})     # a phone's screen
            frames, problems = [], []
            page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(payload)))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(f"{base}/#token={TOKEN}")
            assert page.evaluate("location.hash") == ""                 # the token left the address bar
            page.get_by_role("button", name="Start").click()
            deadline = time.monotonic() + 90
            while sum('"step"' in f for f in frames) < 40 and time.monotonic() < deadline:
                page.wait_for_timeout(250)
            records = [json.loads(f) for f in frames if '"step"' in f]
            assert len(records) >= 40, (frames[:3], problems, page.inner_text("#message"))
            tops = [r["models"][best.name]["top"][0] for r in records[-28:]]     # the model's window is warm
            genre = max(set(tops), key=tops.count)
            assert genre == want["genre"], tops
            assert page.inner_text("#now").startswith(genre)
            page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
            page.get_by_role("button", name="Stop").click()
            page.wait_for_selector("#verdict table", timeout=30_000)
            assert want["genre"] in page.inner_text("#verdict")
            page.set_input_files("#file", str(excerpt))           # a file chosen on the page: posted, its verdict shown
            page.wait_for_selector("#file-verdict table", timeout=60_000)
            shown = page.inner_text("#file-verdict")
            assert EXCERPT in shown and f"{best.name}\t{want['genre']}" in shown, shown
            page.goto(f"{base}/docs")                          # the API's description, drawn from /openapi.json
            page.wait_for_selector("#paths section", timeout=30_000)
            assert "POST /v1/classify" in page.inner_text("#paths") and "413" in page.inner_text("#paths")
            assert problems == []
        finally:
            browser.close()
    if os.environ.get("NYSTREAM_DOCS_SCREENSHOTS"):
        shutil.copy(tmp_path / "page.png", ROOT / "docs" / "serve-page.png")


def test_a_client_that_leaves_mid_body_leaves_no_temporary_file(files):
    """Half of a declared body, then the connection closed: the server's copy of it is removed
    and the server serves on."""
    checkpoints, songs = files
    temp = Path(os.environ.get("TMPDIR", "/tmp"))
    before = set(temp.glob("nystream-upload-*"))
    with serving(checkpoints) as base:
        host, port = base.split("//")[1].split(":")
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(f"POST /v1/classify HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
                      f"Content-Length: 100000\r\n\r\n".encode() + b"\0" * 50_000)
            time.sleep(0.5)
        deadline = time.monotonic() + 20
        while set(temp.glob("nystream-upload-*")) - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(temp.glob("nystream-upload-*")) - before
        assert post(base, songs["a"])[0] == 200
