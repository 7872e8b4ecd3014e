"""The smoothed genre and the per-run verdict (app/runtime/verdict.py), against direct arithmetic
on the same StepResult records."""
import math

import pytest

from app.runtime.records import ModelStep, StepResult
from app.runtime.verdict import Smoother, Tally, top_k
from audio.melspec import HOP_SECONDS

GENRES = ["blues", "classical", "rock"]


def result(step, **probs):
    models = {name: ModelStep(p, GENRES, {"sda": 1, "model": 1}, 0.1, 0, True, None, False, True, 1,
                              "continual", 1, 8) for name, p in probs.items()}
    return StepResult(step, 0.25 * (step + 1), "demo", "musicnn", models, {"frontend": 1.0})


def test_smoother_is_an_exponential_average_with_the_set_time_constant():
    s = Smoother(2.0)
    a = 1 - math.exp(-HOP_SECONDS / 2.0)
    assert s.alpha == pytest.approx(a)
    first = s.update("m", [1.0, 0.0, 0.0])
    assert first == [1.0, 0.0, 0.0]                       # the first hop is taken as is
    for k in range(1, 9):                                 # then a step change decays towards it
        out = s.update("m", [0.0, 0.0, 1.0])
        assert out[2] == pytest.approx(1 - (1 - a) ** k) and out[0] == pytest.approx((1 - a) ** k)
        assert sum(out) == pytest.approx(1.0)
    assert Smoother(0).update("m", [0.2, 0.5, 0.3]) == [0.2, 0.5, 0.3]
    raw = Smoother(0)
    raw.update("m", [1.0, 0.0, 0.0])
    assert raw.update("m", [0.0, 1.0, 0.0]) == [0.0, 1.0, 0.0]     # 0 s: no smoothing
    assert top_k(GENRES, [0.2, 0.5, 0.3], 2) == [("classical", 0.5), ("rock", 0.3)]


def test_tally_gives_the_genre_most_often_on_top_its_share_and_mean_probability():
    runs = [result(0, a=[0.6, 0.3, 0.1], b=[0.1, 0.1, 0.8]),
            result(1, a=[0.2, 0.7, 0.1], b=[0.1, 0.2, 0.7]),
            result(2, a=[0.5, 0.4, 0.1], b=[0.3, 0.3, 0.4]),
            result(3, b=[0.2, 0.1, 0.7])]                             # a left the run
    verdicts = {v.name: v for v in Tally.of(runs).verdicts()}
    a, b = verdicts["a"], verdicts["b"]
    assert (a.genre, a.steps, a.share) == ("blues", 3, pytest.approx(2 / 3))
    assert a.confidence == pytest.approx((0.6 + 0.2 + 0.5) / 3)
    assert (b.genre, b.steps, b.share) == ("rock", 4, 1.0)
    assert b.confidence == pytest.approx((0.8 + 0.7 + 0.4 + 0.7) / 4)
    table = Tally.of(runs).table().splitlines()
    assert table[0].split()[:2] == ["model", "genre"] and table[1].split()[:5] == ["a", "blues", "67%", "43%", "3"]
