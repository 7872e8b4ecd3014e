"""Progress of long offline work: a real tqdm bar on a real terminal (a pty), plain lines with the
time left on a pipe."""
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import time
from app.offline.progress import Progress
with Progress(3, "demo", "track", print) as p:
    for i in range(3):
        time.sleep(0.05)
        p.step(f"track {i} done")
"""


def run(stderr_tty: bool) -> str:
    """SCRIPT's stderr (and stdout) with stderr on a pty or a pipe."""
    if not stderr_tty:
        r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        return r.stdout + r.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # 100 columns
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:                  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(master)
    return out.decode(errors="replace")


def test_a_terminal_gets_a_bar_and_the_lines_above_it():
    out = run(stderr_tty=True)
    assert "demo: 100%" in out and "3/3" in out          # tqdm's bar, finished
    assert all(f"track {i} done" in out for i in range(3))
    assert "s left)" not in out                          # the bar carries the ETA


def test_a_pipe_gets_plain_lines_with_the_time_left():
    lines = run(stderr_tty=False).splitlines()
    assert len(lines) == 3 and "%|" not in "".join(lines)
    for i, line in enumerate(lines):
        assert line.startswith(f"track {i} done (") and line.endswith(" s left)")
    assert lines[-1].endswith("~0 s left)")
