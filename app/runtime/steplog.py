"""A run's step records kept for export, packed and bounded in bytes.

A live ``StepResult`` with six models is about 19 KB of Python objects (13 KB without its
log-mel frames): an hour of hops would be 280 MB. ``StepCodec`` packs a hop into one ``bytes``
(about 0.1 KB per model; what does not change from hop to hop - names, classes, variant, FLOPs
keys - is stored once in a table); the engine process sends hops in this form. ``StepLog`` keeps
packed hops, without the mel frames (the spectrogram keeps its own 10 s), and forgets the oldest
beyond ``budget_bytes``. Reading unpacks equal ``StepResult``s.
"""
from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterator

from .records import ModelStep, StepResult

BUDGET_BYTES = 32 * 2**20     # an hour of six models is about 10 MB

_HOP = struct.Struct("<IqdqqIdd HH")   # kind, step, audio_time, frontend_flops, dropped, rate, ready, done, models, events
_MODEL = struct.Struct("<IdqB")        # kind, latency_ms, state_bytes, flags (landmark_update, warm)
_LEN = struct.Struct("<I")
_MICRO = 1_000_000                     # probabilities are rounded to 6 decimals: stored as integer millionths


class StepCodec:
    """Packs a ``StepResult`` (without ``mel``) into one ``bytes`` and back. What does not change
    from hop to hop is kept once in a table of kinds; a receiver in another process learns the
    kinds the sender added since it last asked (``kinds[k:]``, sent before the packed hop)."""

    def __init__(self):
        self.kinds: list[tuple] = []           # constant parts of hops and model steps
        self._kind_of: dict[tuple, int] = {}

    def learn(self, kinds) -> None:
        """Add a sender's new kinds, in its order."""
        for key in kinds:
            self._kind(tuple(key))

    def pack(self, r: StepResult) -> bytes:
        parts = [_HOP.pack(self._kind((r.source, r.frontend, tuple(r.stages))), r.step, r.audio_time,
                           r.frontend_flops, r.dropped_hops, r.input_rate, r.ready_time, r.done_time,
                           len(r.models), len(r.events)),
                 struct.pack(f"<{len(r.stages)}d", *r.stages.values())]
        for name, m in r.models.items():
            kind = self._kind((name, tuple(m.classes), tuple(m.flops), m.trained, m.landmark_mode,
                               m.spacing, m.variant, m.layers, m.window))
            parts.append(_MODEL.pack(kind, m.latency_ms, m.state_bytes, m.landmark_update | m.warm << 1))
            parts.append(struct.pack(f"<{len(m.probabilities)}I{len(m.flops)}q",
                                     *(round(p * _MICRO) for p in m.probabilities), *m.flops.values()))
        for e in r.events:
            text = e.encode()
            parts += [_LEN.pack(len(text)), text]
        return b"".join(parts)

    def _kind(self, key: tuple) -> int:
        i = self._kind_of.get(key)
        if i is None:
            i = self._kind_of[key] = len(self.kinds)
            self.kinds.append(key)
        return i

    def unpack(self, b: bytes) -> StepResult:
        kind, step, audio_time, fe_flops, dropped, rate, ready, done, n_models, n_events = _HOP.unpack_from(b)
        source, frontend, stage_keys = self.kinds[kind]
        at = _HOP.size
        stages = dict(zip(stage_keys, struct.unpack_from(f"<{len(stage_keys)}d", b, at)))
        at += 8 * len(stage_keys)
        models = {}
        for _ in range(n_models):
            kind, latency, state_bytes, flags = _MODEL.unpack_from(b, at)
            at += _MODEL.size
            name, classes, flop_keys, trained, mode, spacing, variant, layers, window = self.kinds[kind]
            values = struct.unpack_from(f"<{len(classes)}I{len(flop_keys)}q", b, at)
            at += 4 * len(classes) + 8 * len(flop_keys)
            models[name] = ModelStep(
                probabilities=[v / _MICRO for v in values[:len(classes)]], classes=list(classes),
                flops=dict(zip(flop_keys, values[len(classes):])), latency_ms=latency,
                state_bytes=state_bytes, trained=trained, landmark_mode=mode,
                landmark_update=bool(flags & 1), warm=bool(flags & 2), spacing=spacing, variant=variant,
                layers=layers, window=window)
        events = []
        for _ in range(n_events):
            (n,) = _LEN.unpack_from(b, at)
            events.append(b[at + 4:at + 4 + n].decode())
            at += 4 + n
        return StepResult(step, audio_time, source, frontend, models, stages, frontend_flops=fe_flops,
                          dropped_hops=dropped, input_rate=rate, ready_time=ready, done_time=done,
                          events=events)


class StepLog:
    """Append-only, iterable store of ``StepResult``s (without ``mel``), oldest first."""

    def __init__(self, budget_bytes: int = BUDGET_BYTES):
        self.budget_bytes = budget_bytes
        self._hops: deque[bytes] = deque()
        self._codec = StepCodec()
        self.nbytes = 0                        # packed bytes held (the kinds table aside)

    def __len__(self) -> int:
        return len(self._hops)

    def __iter__(self) -> Iterator[StepResult]:
        return (self._codec.unpack(b) for b in list(self._hops))

    def __getitem__(self, i: int) -> StepResult:
        """The i-th hop kept (negative from the newest); the ends are O(1)."""
        return self._codec.unpack(self._hops[i])

    def clear(self) -> None:
        self._hops.clear()
        self._codec = StepCodec()
        self.nbytes = 0

    def append(self, r: StepResult) -> None:
        packed = self._codec.pack(r)
        self._hops.append(packed)
        self.nbytes += len(packed)
        while self.nbytes > self.budget_bytes and len(self._hops) > 1:
            self.nbytes -= len(self._hops.popleft())
