"""The "Use it from Python" page's example runs exactly as printed (docs/python.md), in a fresh
interpreter outside the checkout, on a real music file, and prints one line per hop."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from doc_example import example
from audio_helpers import tone, write

ROOT = Path(__file__).resolve().parents[2]


def test_the_python_page_example_runs_as_printed(tmp_path):
    code = example("python.md")
    assert len(code.strip().splitlines()) < 30
    write(tmp_path / "song.wav", np.concatenate([tone(1.0, 22050, f) for f in (220, 330, 440, 660)] * 2), 22050)
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 8 * 4 + 1                    # 8 s of audio: 32 hops, then the probabilities
    for i, line in enumerate(lines[:-1]):
        t, unit, genre, p, sda, _, _, model, _, _, ms, _, *_ = line.split()
        assert (float(t), unit) == ((i + 1) * 0.25, "s") and 0 < float(p) <= 1
        assert int(sda.replace(",", "")) > 0 and int(model.replace(",", "")) > int(sda.replace(",", ""))
        assert float(ms) > 0
    probabilities = eval(lines[-1])                   # a dict literal: genre -> probability
    # ten probabilities printed to 6 decimals: their sum is 1 within 10 x 5e-7 = 5e-6 (float32
    # softmax adds ~1e-7), so 1e-5 leaves a margin of 2
    assert len(probabilities) == 10 and abs(sum(probabilities.values()) - 1) < 1e-5
