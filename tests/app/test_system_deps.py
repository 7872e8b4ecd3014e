"""scripts/system-deps.sh, as `make run` and `make test` call it first: a Python that cannot create
a virtual environment (Debian's python3 without python3-venv) stops `make` with the one command
to run, where the script cannot install it; a Python that can goes on, whatever else is missing."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(tmp_path, python: str) -> subprocess.CompletedProcess:
    """The script with no apt-get and no dpkg on its PATH (nothing can be installed), as a user
    without a package manager it can drive."""
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    for tool in ("id",):
        (tools / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    env = {"PATH": str(tools), "PYTHON": python, "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run(["/bin/bash", str(ROOT / "scripts" / "system-deps.sh")], env=env,
                          capture_output=True, text=True, timeout=60)


def test_no_venv_support_stops_with_the_command_to_run(tmp_path):
    no_venv = tmp_path / "python-without-ensurepip"
    no_venv.write_text("#!/bin/sh\nexit 1\n")                # `import ensurepip` fails, as on a stock Debian
    no_venv.chmod(0o755)
    r = run_script(tmp_path, str(no_venv))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert "python3-venv" in lines[0] and lines[0].startswith("note: install ")
    assert lines[-1] == (f"error: {no_venv} cannot create a virtual environment (no ensurepip); "
                         f"run: sudo apt-get install python3-venv, then make again")


def test_with_venv_support_it_goes_on_and_names_what_is_missing(tmp_path):
    import sys
    r = run_script(tmp_path, sys.executable)
    assert r.returncode == 0, r.stderr
    assert "python3-venv" not in r.stderr and r.stderr.startswith("note: install g++ libportaudio2")
