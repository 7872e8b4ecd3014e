"""A record's probabilities are rounded to 6 decimals in one vectorised call per model and hop
(app/runtime/records.py ``rounded``): the floats Python's ``round(v, 6)`` gives, for every
float32 value. Oracle: ``round`` itself, on random values over every exponent a probability can
take, on values next to each multiple of 1e-6 (where a rounding rule would show), and on the
boundaries."""
import numpy as np

from app.runtime.records import rounded


def python_round(p: np.ndarray) -> list:
    return [round(v, 6) for v in p.tolist()]


def test_rounded_equals_pythons_round_for_float32_values():
    g = np.random.default_rng(0)
    random = g.random(200_000, dtype=np.float32)
    tiny = (g.random(20_000) * 10.0 ** g.integers(-45, 0, 20_000)).astype(np.float32)       # every exponent
    # the float32 values next to n / 1e6 + 0.5e-6, the midpoints where half-up and half-even would differ
    mids = ((np.arange(0, 1_000_000, 37) + 0.5) / 1e6).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(0)), mids, np.nextafter(mids, np.float32(1))])
    edges = np.array([0.0, 1.0, 1e-6, 5e-7, np.finfo(np.float32).tiny, np.finfo(np.float32).smallest_subnormal,
                      0.9999995, 3.4e38, -0.25], np.float32)
    for p in (random, tiny, near, edges):
        got, want = rounded(p), python_round(p)
        assert got == want, next((v, a, b) for v, a, b in zip(p.tolist(), got, want) if a != b)
    # and row by row, as a hop's (S, C) block
    block = random[:1000].reshape(100, 10)
    assert rounded(block) == [python_round(row) for row in block]
