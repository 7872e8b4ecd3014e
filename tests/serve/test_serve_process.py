"""The real `serve` command in its own process: docs/serve.md's Python example runs as printed
against it, and SIGTERM drains it (a streaming client gets its verdict and a close 1001, the
server exits 0); it declines WebSocket compression."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from audio.frontends import build_frontend, frontend_metadata
from audio.gtzan import GENRES
from doc_example import example
from audio_helpers import tone, write
from app.checkpoint import save_checkpoint
from tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_runs_and_sigterm_drains(tmp_path):
    model = tiny_model("continual", n=8, in_dim=50, seed=0)
    save_checkpoint(model, tmp_path / "m.pt", classes=list(GENRES), frontend=frontend_metadata(build_frontend("musicnn")))
    server = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "serve", "--port", "0", "--checkpoint",
                               str(tmp_path / "m.pt")], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = server.stderr.readline()
        while line and "# serving" not in line:
            line = server.stderr.readline()
        url = re.search(r"(ws://\S+/v1/stream)", line).group(1)
        assert "models continual, device cpu, float32" in line        # what runs where
        # the page's example, as printed, on a 44.1 kHz stereo WAV
        write(tmp_path / "song.wav", tone(2.0, 44100, 330.0, channels=2), 44100)
        (tmp_path / "example.py").write_text(example("serve.md"))
        r = subprocess.run([sys.executable, "example.py", url, "song.wav"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
        assert r.returncode == 0, r.stderr[-2000:]
        lines = r.stdout.splitlines()
        assert lines[0] == "['continual']" and len(lines) == 1 + 8 + 1
        assert [line.split()[:2] for line in lines[1:-1]] == [[str(i), str(0.25 * (i + 1))] for i in range(8)]
        # a client streaming in real time when SIGTERM comes
        got = {"messages": []}

        def stream():
            with connect(url, proxy=None) as ws:       # offering permessage-deflate, as by default
                got["extensions"] = ws.protocol.extensions
                ws.send(json.dumps({"sample_rate": 16000, "channels": 1, "format": "f32le"}))
                ws.recv(timeout=20)

                def send():
                    try:
                        for _ in range(40):
                            ws.send(np.full(4000, 0.05, "<f4").tobytes())
                            time.sleep(0.25)
                    except ConnectionClosed:
                        pass
                threading.Thread(target=send, daemon=True).start()
                try:
                    for text in ws:
                        got["messages"].append(json.loads(text))
                except ConnectionClosed:
                    pass
            got["close"] = (ws.close_code, ws.close_reason)

        client = threading.Thread(target=stream)
        client.start()
        time.sleep(2.0)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=40) == 0
        client.join(timeout=20)
        assert got["close"] == (1001, "the server is shutting down")
        assert got["extensions"] == []         # the server declines compression (docs/serve.md)
        *records, verdict = got["messages"]
        assert len(records) >= 4 and verdict["hops"] == len(records) == verdict["verdict"]["continual"]["steps"]
        assert len(records) < 30               # the drain ended the stream: the client's later audio is not read
        assert "# SIGTERM: draining 1 streams" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
