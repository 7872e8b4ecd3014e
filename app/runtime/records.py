"""Step records: what one hop produced, per model, and their CSV / JSON / terminal forms."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

import numpy as np

from audio.errors import printable


@dataclass
class ModelStep:
    """One model's answer to one hop."""
    probabilities: list[float]         # (C,) over ``classes``
    classes: list[str]                 # class names, from the model's checkpoint
    flops: dict[str, int]              # this step: 'sda', 'attention' (with projections), 'model'
    latency_ms: float                  # wall time of the model's step
    state_bytes: int                   # streaming state held
    trained: bool                      # weights from a trained checkpoint
    landmark_mode: str | None          # in use now: 'continual' / 'segment' / 'fixed' / None
    landmark_update: bool              # this step installed new landmarks
    warm: bool                         # the window held n tokens (warm-up over)
    spacing: int                       # hops between the tokens the model is fed
    variant: str
    layers: int
    window: int
    top: tuple[str, float] = field(init=False)   # (class, probability) of the most probable class
    smoothed_top: tuple[str, float] | None = None   # (class, probability) of the smoothed probabilities
                                                    # (classify --smooth, the window's reading); None: not smoothed

    def __post_init__(self):     # once here: the window reads it for every kept step each frame
        i = max(range(len(self.probabilities)), key=self.probabilities.__getitem__)
        self.top = (self.classes[i], self.probabilities[i])


@dataclass
class StepResult:
    step: int                                   # hop / token index
    audio_time: float                           # seconds of audio up to the end of this hop
    source: str
    frontend: str                               # which front end (and weights) made the token
    models: dict[str, ModelStep]                # model name -> its answer
    stages: dict[str, float]                    # ms: 'frontend' (= 'mel' + 'network')
    frontend_flops: int = 0                     # FLOPs of the front-end network for this hop
    dropped_hops: int = 0                       # hops the source dropped so far
    input_rate: int = 0                         # the source's sample rate before resampling (Hz)
    ready_time: float = 0.0                     # time.monotonic() when the hop's last sample arrived
    done_time: float = 0.0                      # time.monotonic() when every model had stepped
    events: list[str] = field(default_factory=list)   # control changes applied before this hop
    mel: np.ndarray | None = field(default=None, repr=False)   # (k, bands) this hop's log-mel frames

    def to_dict(self) -> dict:
        """The record as dicts of its fields, without ``mel``, for serialising: its lists are
        the record's own, not copies (``asdict`` deep-copies them, the log-mel frames included:
        5.4x as long for a record of five models, one-off timing)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "mel"}
        d["models"] = {name: {f.name: getattr(m, f.name) for f in fields(m)
                              if f.name != "smoothed_top" or m.smoothed_top is not None}
                       for name, m in self.models.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)


def rounded(p: np.ndarray) -> list:
    """Float32 probabilities (C,) or (S, C) rounded to 6 decimals as lists: the floats
    ``round(v, 6)`` gives, in one vectorised call. For a float32 v, v x 1e6 is exact in float64
    (24 + 14 significant bits), no float32 lies halfway between two multiples of 1e-6, and a
    correctly rounded division by 1e6 then gives round's float (tests/app/test_records.py)."""
    return np.round(np.asarray(p, np.float32).astype(np.float64), 6).tolist()


def record_from_dict(d: dict) -> StepResult:
    """A StepResult from its ``to_dict()`` (a record read back from JSON: `listen`)."""
    d = dict(d)
    d["models"] = {name: ModelStep(**{k: v for k, v in m.items() if k != "top"}) for name, m in d["models"].items()}
    return StepResult(**d)


def reference_for(name: str, models: dict[str, ModelStep]) -> str | None:
    """The model that ``name`` is compared against: a running `regular` model (exact attention),
    preferring one with the same weights status (trained or not), blocks and window."""
    me = models[name]
    pool = [n for n, s in models.items() if s.variant == "regular" and n != name]
    if not pool:
        return None
    return max(pool, key=lambda n: (models[n].trained == me.trained, models[n].layers == me.layers,
                                    models[n].window == me.window))


def csv_row(r: StepResult) -> dict:
    """One CSV row per hop: the hop's fields, then each model's columns prefixed 'name.'."""
    row = {"step": r.step, "audio_time_s": r.audio_time, "source": r.source, "frontend": r.frontend,
           "frontend_ms": round(r.stages["frontend"], 3), "frontend_flops": r.frontend_flops,
           "dropped_hops": r.dropped_hops, "events": " | ".join(r.events)}
    for name, m in r.models.items():
        row[f"{name}.top"] = m.top[0]
        if m.smoothed_top is not None:
            row[f"{name}.smoothed_top"] = m.smoothed_top[0]
        row[f"{name}.untrained"] = not m.trained
        row[f"{name}.landmark_mode"] = m.landmark_mode or ""
        row[f"{name}.landmark_update"] = m.landmark_update
        row[f"{name}.window_full"] = m.warm
        for g, p in zip(m.classes, m.probabilities):
            row[f"{name}.p_{g}"] = p
        for k, v in m.flops.items():
            row[f"{name}.flops_{k}"] = v
        row[f"{name}.latency_ms"] = round(m.latency_ms, 3)
        row[f"{name}.state_bytes"] = m.state_bytes
    return row


def human(r: StepResult) -> str:
    """One terminal line per hop; untrained models are marked *."""
    cells = []
    for name, m in r.models.items():
        genre, p = m.top
        smoothed = "" if m.smoothed_top is None else f", smoothed {printable(m.smoothed_top[0])} {m.smoothed_top[1]:.2f}"
        cells.append(f"{printable(name)}{'' if m.trained else '*'}: {printable(genre)} {p:.2f}{smoothed} "
                     f"({m.flops['sda'] / 1e3:.1f}k SDA FLOPs, {m.latency_ms:.2f} ms)")
    return (f"[{r.step:4d}] {r.audio_time:7.2f}s  front end {r.stages['frontend']:.1f} ms, "
            f"{r.frontend_flops / 1e6:.0f}M FLOPs | " + " | ".join(cells))


def percentile(xs, q: float) -> float:
    """q-quantile (0..1) of ``xs`` by nearest rank; nan for no data."""
    s = sorted(xs)
    if not s:
        return math.nan
    return s[min(len(s) - 1, int(q * len(s)))]
