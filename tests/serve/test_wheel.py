"""A wheel carries the shipped assets: built from the project's files, installed (without its
dependencies, which the test environment lends) into a fresh virtual environment, its
`nystream serve` started from another directory finds the musicnn weights and the shipped models,
and answers its page."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("app", "audio", "models", "assets", "pyproject.toml", "README.md", "main.py")


@pytest.mark.slow
def test_an_installed_wheel_serves_the_shipped_models_from_any_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(
            ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    r = subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("nystream-*.whl")
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True, timeout=120)
    r = subprocess.run(pip + ["--python", str(fresh / "bin" / "python"), "install", "--no-deps", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (fresh / "share" / "nystream" / "assets" / "musicnn" / "MSD_musicnn.safetensors").is_file()
    # the dependencies from this environment, the project only from the wheel
    lent = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(lent)}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    server = subprocess.Popen([str(fresh / "bin" / "nystream"), "serve", "--port", "0"], cwd=elsewhere, env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        while line and "# serving" not in line:
            line = server.stderr.readline()
        assert line, server.stderr.read()[-2000:]
        port = re.search(r"ws://127\.0\.0\.1:(\d+)/", line).group(1)
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=20).read())
        assert health["models"] == ["regular", "continual", "nystrom", "continual_nystrom", "continual_nystrom/fixed"]
        assert health["frontend"].startswith("musicnn MSD_musicnn (pretrained")
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=20).read()     # the page, from the wheel
        assert b'<button id="start" type="button">Start</button>' in page
        assert b"registerProcessor" in urllib.request.urlopen(f"http://127.0.0.1:{port}/static/worklet.js", timeout=20).read()
        code = subprocess.run([str(fresh / "bin" / "python"), "-c", "import app, audio; print(app.__file__, audio.__file__)"],
                              cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60).stdout
        assert code.count(str(fresh)) == 2                    # the wheel's code, not the checkout's
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
