"""`serve --workers 2`: the real command, two engine processes behind its edge. The streams
spread one on each worker, health sums the workers, each client's records equal `classify FILE
--jsonl`; a killed worker cuts only its own client's stream (1012 with a reason) and is replaced;
SIGTERM drains (the client's records, its verdict, 1001) and every worker stops; a SIGKILLed
parent's workers stop too."""
import importlib.util
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from audio.sources import FileSource
from cli_helpers import run_command
from process_helpers import children
from test_serve import classify_jsonl, repeated, same
from ws_clients import accepted, stream

ROOT = Path(__file__).resolve().parents[2]


def workers_of(pid: int) -> list[int]:
    """The server's worker processes (its spawned children; one that ends while read is left out)."""
    workers = []
    for k in children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes():
                workers.append(k)
        except OSError:
            pass
    return workers


def test_two_workers_split_the_streams_a_killed_one_is_replaced_and_sigterm_drains(files, capsys, errors, tmp_path):
    checkpoints, songs = files
    want = classify_jsonl(capsys, songs["a"], checkpoints)
    server = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "serve", "--processes", "2", "--max-streams", "2",
                               "--max-streams-per-address", "2",
                               "--port", "0", *repeated("--checkpoint", checkpoints)], stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path)
    lines = []
    try:
        line = server.stderr.readline()
        while line and "# serving" not in line:
            line = server.stderr.readline()
        assert "2 workers of up to 1 streams each" in line, line
        url = re.search(r"(ws://\S+/v1/stream)", line).group(1)
        threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True).start()
        health = lambda: json.loads(urllib.request.urlopen(url.replace("ws://", "http://").replace(  # noqa: E731
            "/v1/stream", "/v1/health"), timeout=30).read())
        assert (health()["workers"], health()["capacity"]) == (2, 2)
        hops = list(FileSource(songs["a"]))
        clients = [accepted(url), accepted(url)]
        assert health()["streams_by_worker"] == [1, 1]          # the edge spread them
        got = [{}, {}]
        threads = [threading.Thread(target=stream, args=(ws, hops, g, 0.25)) for ws, g in zip(clients, got)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        pids = workers_of(server.pid)
        assert len(pids) == 2
        subprocess.run(["kill", "-9", str(pids[0])], check=True)
        for t in threads:
            t.join(timeout=60)
        cut = [g for g in got if g["close"] != 1000]
        whole = [g for g in got if g["close"] == 1000]
        assert len(cut) == 1 and len(whole) == 1, [g["close"] for g in got]
        assert cut[0]["close"] == 1012 and "stopped" in cut[0]["reason"]
        same(errors, whole[0]["records"], want)
        # the killed worker is replaced; then a client streaming when SIGTERM comes is drained
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (len(workers_of(server.pid)) < 2 or health()["workers"] < 2):
            time.sleep(0.5)
        assert health()["workers"] == 2 and any("exited (code -9); starting another" in x for x in lines), lines
        late = {}
        drained = threading.Thread(target=stream, args=(accepted(url), hops * 4, late, 0.25))
        drained.start()
        time.sleep(1.5)
        pids = workers_of(server.pid)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        drained.join(timeout=30)
        assert (late["close"], late["reason"]) == (1001, "the server is shutting down")
        assert late["verdict"]["hops"] == len(late["records"]) >= 4
        assert not [p for p in pids if Path(f"/proc/{p}").exists()]    # (their parent reaped them)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_workers_are_for_the_cpu_plain_server_and_a_missing_checkpoint_is_one_line(tmp_path):
    """Through the command's entry point in this process, and with --processes 2 in a process of
    its own (its workers, spawned, find the file missing)."""
    for extra in (["--ray"], ["--device", "cuda"]):
        r = run_command("serve", "--processes", "2", *extra)
        assert r.returncode != 0 and "--processes is for the plain server on the CPU" in r.stderr, r.stderr
    ray = [["--ray", "local"]] if importlib.util.find_spec("ray") else []
    gone = ["--checkpoint", str(tmp_path / "gone.pt")]
    for way in (["--processes", "1"], ["--processes", "2"], *ray):   # checked before serving: no traceback
        if way[-1] == "2":
            r = subprocess.run([sys.executable, str(ROOT / "main.py"), "serve", "--port", "0", *way, *gone],
                               capture_output=True, text=True, timeout=300)
            assert "Traceback" not in r.stderr, r.stderr[-2000:]
        else:
            r = run_command("serve", "--port", "0", *way, *gone)   # an exception other than the one line would raise
        assert r.returncode == 1, r.stderr[-2000:]
        assert f"serve: error: checkpoint not found: {tmp_path / 'gone.pt'}" in r.stderr.splitlines()[0], r.stderr


def test_workers_stop_when_their_parent_is_killed(files, tmp_path):
    """SIGKILL leaves the parent no time to stop its workers: each dies with it (PR_SET_PDEATHSIG)
    instead of serving on, orphaned, on its loopback port."""
    checkpoints, _ = files
    server = subprocess.Popen([sys.executable, str(ROOT / "main.py"), "serve", "--processes", "2", "--max-streams", "2",
                               "--max-streams-per-address", "2",
                               "--port", "0", "--checkpoint", checkpoints[0]], stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path)
    try:
        line = server.stderr.readline()
        while line and "# serving" not in line:
            line = server.stderr.readline()
        pids = workers_of(server.pid)
        assert len(pids) == 2, line
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 30
    while [p for p in pids if Path(f"/proc/{p}").exists()] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
