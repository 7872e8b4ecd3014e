"""Reading a genre off a stream: a smoothed genre per model (exponential moving average of its
probabilities) and a verdict per run (the genre most often on top, its share of the steps and
its mean probability; the classes of highest mean probability). Qt-free: the window and
`classify` both use it."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from audio.errors import printable


class Smoother:
    """Per model, probabilities averaged exponentially with time constant ``seconds`` (0: the
    raw step). One update per hop of HOP_SECONDS."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds
        self.state: dict[str, list[float]] = {}

    @property
    def alpha(self) -> float:
        """Weight of the newest hop: 1 - exp(-hop / seconds)."""
        from audio.melspec import HOP_SECONDS             # numpy: not for `classify --help`
        return 1.0 if self.seconds <= 0 else 1.0 - math.exp(-HOP_SECONDS / self.seconds)

    def update(self, name: str, probabilities: list[float]) -> list[float]:
        """The smoothed probabilities of ``name`` after this hop's ``probabilities`` (C,)."""
        old, a = self.state.get(name), self.alpha
        if old is None or len(old) != len(probabilities):
            new = list(probabilities)
        else:
            new = [o + a * (p - o) for o, p in zip(old, probabilities)]
        self.state[name] = new
        return new

    def reset(self) -> None:
        self.state.clear()


def top_k(classes: list[str], probabilities: list[float], k: int = 3) -> list[tuple[str, float]]:
    """The k most probable (class, probability) pairs, most probable first."""
    order = sorted(range(len(probabilities)), key=probabilities.__getitem__, reverse=True)
    return [(classes[i], probabilities[i]) for i in order[:k]]


TOP = 3             # classes a verdict lists by mean probability (classify --top)


@dataclass
class Verdict:
    name: str           # model
    genre: str          # most often on top over the run
    share: float        # fraction of the model's steps with ``genre`` on top
    confidence: float   # mean probability of ``genre`` over those steps (all steps)
    steps: int
    top: list = field(default_factory=list)   # [[class, mean probability]], highest first


class Tally:
    """Per model over a run: how often each genre was on top and each genre's summed probability."""

    def __init__(self):
        self.tops: dict[str, dict[str, int]] = {}
        self.sums: dict[str, dict[str, float]] = {}

    @classmethod
    def of(cls, results) -> "Tally":
        tally = cls()
        for r in results:
            tally.add(r)
        return tally

    def add(self, result) -> None:
        """One StepResult."""
        for name, m in result.models.items():
            tops, sums = self.tops.setdefault(name, {}), self.sums.setdefault(name, {})
            tops[m.top[0]] = tops.get(m.top[0], 0) + 1
            for c, p in zip(m.classes, m.probabilities):
                sums[c] = sums.get(c, 0.0) + p

    def verdicts(self, top: int = TOP) -> list[Verdict]:
        """Per model: its verdict, with the ``top`` classes of highest mean probability."""
        out = []
        for name, tops in self.tops.items():
            steps = sum(tops.values())
            genre, n = max(tops.items(), key=lambda kv: kv[1])
            means = sorted(((c, p / steps) for c, p in self.sums[name].items()), key=lambda cp: -cp[1])
            out.append(Verdict(name, str(genre), n / steps, self.sums[name][genre] / steps, steps,
                               [[str(c), round(p, 6)] for c, p in means[:top]]))
        return out

    def table(self, top: int = TOP) -> str:
        """The verdicts as an aligned text table (one row per model)."""
        return verdict_table(self.verdicts(top))


def verdict_message(tally: Tally, source, error: str | None = None, top: int = TOP) -> dict:
    """A stream's verdict as data, the service's verdict message and ``classify --jsonl``'s last
    record of a stream: {"verdict": {model: {genre, share, confidence, steps, top}}, "source",
    "hops", "nonfinite_zeroed", "clipped", "error"}; ``top``: [[class, mean probability]] of the
    ``top`` classes of highest mean probability, highest first."""
    return {"verdict": {v.name: {k: x for k, x in asdict(v).items() if k != "name"} for v in tally.verdicts(top)},
            "source": source.name, "hops": source.stats.hops, "nonfinite_zeroed": source.stats.nonfinite,
            "clipped": source.stats.clipped, "error": error}


SUMMARY_FIELDS = ("file", "source", "model", "genre", "share", "confidence", "hops", "error")


def summary_rows(file: str, message: dict) -> list[dict]:
    """``classify --summary``'s rows for one file from its verdict message: one per model, or one
    with only the error when no model answered (a file that could not be read)."""
    base = {"file": file, "source": message.get("source", ""), "hops": message.get("hops", 0),
            "error": message.get("error") or ""}
    rows = [{**base, "model": name, "genre": v["genre"], "share": round(v["share"], 6),
             "confidence": round(v["confidence"], 6)} for name, v in message["verdict"].items()]
    rows = rows or [{**base, "model": "", "genre": "", "share": "", "confidence": ""}]
    return [{k: row[k] for k in SUMMARY_FIELDS} for row in rows]          # the columns in their order


def verdict_table(verdicts: list[Verdict]) -> str:
    rows = [("model", "genre", "share of steps", "mean probability", "steps", "highest mean probabilities")]
    rows += [(printable(v.name), printable(v.genre), f"{100 * v.share:.0f}%", f"{100 * v.confidence:.0f}%",
              str(v.steps), ", ".join(f"{printable(c)} {100 * p:.0f}%" for c, p in v.top)) for v in verdicts]
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
