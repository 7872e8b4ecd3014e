"""A shard of the engine (app/runtime/engine.py): up to ``capacity`` streams of one front end, each
model in one batch (models/stream/batch.py) with a slot per stream (a slot per phase for a model
fed every k-th hop), the front end in one batch too; ``hop()`` steps them all once
(sherpa-onnx's server loop).

A stream joins at any hop and leaves when its source ends or fails, or when a model answers it
non-finite values: the others go on, and no stream's values depend on which others share the
batch. The front end takes every stream's new samples (musicnn: on CUDA in one copy, framed in
one gather there; on the CPU framed stream by stream), their log-mels in one call on the
network's device (the host's values bit for bit, audio/musicnn/mel.py), then the network once
for every stream of the hop; VGGish takes each stream's log-mel on the host. A hop's per-stream
host work is its source's next hop and its record; the records are built from per-model arrays
(the batch's FLOPs, landmark events and warm-up for all streams at once).

Models are added, removed, reset and switched between landmark modes for all the shard's
streams at once (the engine's control, between hops): an added model's window fills from its
next hop, a reset one starts afresh, a switched one's state is rebuilt for the new landmarks.

A record's ``latency_ms`` for a model is the batched step's time divided by the streams in it.
On CUDA a hop waits for the device once, when it copies every model's probabilities back; the
log-mel's, the network's and each model's times are then read from CUDA events recorded between
them (the device's timeline, launch gaps included).
"""
from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from audio.errors import AudioError, FrontEndMismatchError
from audio.frontends import as_frontend
from audio.melspec import HOP, HOP_SECONDS
from models.stream.batch import StreamBatch, steps_to_steady

from .memory import many_streams_heap
from .records import ModelStep, StepResult, rounded


def batch_of(model, capacity: int, kernels=None):
    """The slots of ``model`` for ``capacity`` streams: a StreamBatch (its compiled backend from
    when ``kernels`` are ready), or for an exported step (app/runtime/onnx_step.py) its OnnxBatch."""
    make = getattr(model, "batch", None)
    return make(capacity) if make is not None else StreamBatch(model.eval(), capacity, kernels=kernels)


def check_frontend(entry, frontend) -> None:
    """FrontEndMismatchError unless ``entry``'s model takes ``frontend``'s tokens."""
    if (entry.frontend is not None and entry.frontend != frontend.name) or entry.model.cfg.in_dim != frontend.token_dim:
        raise FrontEndMismatchError(
            f"{entry.name} was trained on {entry.frontend or f'{entry.model.cfg.in_dim}-d'} tokens but the "
            f"streams' front end is {frontend.name} ({frontend.token_dim}-d); choose the front end it was trained on")


@dataclass
class Stream:
    number: int                          # order of joining, 0-based
    source: object                       # a hop source: FileSource, DemoSource, ...
    hops: Iterator[np.ndarray]
    frontend_slot: int                   # its slot in the front end's batch
    slots: dict[str, list[int]]          # model name -> its slot for each phase (spacing)
    step: int = 0                        # hops taken
    error: str | None = None             # why it left early
    shard: int = 0                       # which shard of the engine holds it
    ready_time: float = 0.0              # time.monotonic() when its last hop's last sample was due

    @property
    def name(self) -> str:
        return getattr(self.source, "name", f"stream {self.number}")


class StreamsShard:
    """Every model of ``entries`` (app/runtime/lineup.py) over up to ``capacity`` streams of one
    front end, in one batch per model: ``hop()`` steps them all. ``errors`` (a list, the
    engine's) gets the streams that left early, with why. ``kernels``: when the models' compiled
    backend is ready (app/runtime/kernels.py; None: at once)."""

    def __init__(self, frontend, entries, capacity: int, errors: list | None = None, kernels=None):
        self.frontend = as_frontend(frontend)
        self.kernels = kernels
        self.entries, self.batches = {}, {}
        self.capacity = capacity
        self.streams: list[Stream] = []
        self.errors: list[tuple[Stream, str]] = [] if errors is None else errors
        self.on_leave = None                 # callback(stream) after a stream leaves (Engine.on_leave)
        self.numbers: list[int] = []         # the joining numbers of the last hop's records, in order
        self.frontend_batch = self.frontend.batch(capacity)
        self.device = self.frontend.device
        for e in entries:
            self.add_model(e, self.batches_for(e))

    @torch.no_grad()
    def warm(self) -> None:
        """Ready to serve (before any stream joins). What initialises on first use runs now, not
        in the first streams' hops: each model steps a scratch stream of random tokens through its
        warm-up and one landmark segment (in the compiled backend where its kernels are ready:
        its batch asked for them, app/runtime/kernels.py), and the front end takes two hops of
        silence in a slot that is then free again.
        Then everything alive in the process leaves the cycle collector's view (``gc.freeze``): a
        full collection walks every such object, and the records of many streams set one off
        every few dozen hops (docs/benchmarks.md, design measurements). Cyclic garbage alive at
        the freeze is never collected. And the process's heap is set for many streams
        (app/runtime/memory.py: a hop's temporaries reuse memory, not fresh pages). Nothing of it
        stays in a stream."""
        many_streams_heap()
        for e in self.entries.values():
            warm_model(e.model, self.device, self.kernels)
        slot = self.frontend_batch.join()
        for _ in range(2):
            self.frontend_batch.push([slot], [np.zeros(HOP, np.float32)])
        self.frontend_batch.leave(slot)
        gc.freeze()

    # ------------------------------------------------------------------ models, live
    def batches_for(self, entry):
        """The batch of ``entry``'s model for this shard (a slot per stream and phase); made
        off the processing thread when a model is added live, then installed by ``add_model``."""
        check_frontend(entry, self.frontend)
        return batch_of(entry.model, self.capacity * entry.spacing, self.kernels)

    def add_model(self, entry, batch) -> None:
        """``entry`` runs from the next hop, every stream in slots of ``batch`` (its window fills from there)."""
        self.entries[entry.name], self.batches[entry.name] = entry, batch
        for stream in self.streams:
            stream.slots[entry.name] = [batch.join() for _ in range(entry.spacing)]

    def remove_model(self, name: str) -> None:
        del self.entries[name], self.batches[name]
        for stream in self.streams:
            stream.slots.pop(name, None)

    def reset_model(self, name: str) -> None:
        """Every stream's state of model ``name`` starts afresh (from its next hop)."""
        batch = self.batches[name]
        for stream in self.streams:
            for slot in stream.slots[name]:
                batch.leave(slot)
            stream.slots[name] = [batch.join() for _ in stream.slots[name]]

    def set_landmark_mode(self, name: str) -> None:
        """Model ``name``'s streams to the landmark mode its model is in now, live."""
        self.batches[name].set_landmark_mode(self.entries[name].model.landmark_mode)

    # ------------------------------------------------------------------ streams
    def join(self, source, number: int) -> Stream:
        """A new stream of ``source`` (the engine's ``number``-th) from its first hop; ValueError
        when every slot is taken."""
        if len(self.streams) >= self.capacity:
            raise ValueError(f"all {self.capacity} streams are taken")
        slots = {name: [self.batches[name].join() for _ in range(e.spacing)] for name, e in self.entries.items()}
        stream = Stream(number, source, iter(source), self.frontend_batch.join(), slots)
        self.streams.append(stream)
        return stream

    def leave(self, stream: Stream, error: str | None = None) -> None:
        self.frontend_batch.leave(stream.frontend_slot)
        for name, slots in stream.slots.items():
            for slot in slots:
                self.batches[name].leave(slot)
        self.streams.remove(stream)
        close = getattr(stream.source, "close", None)
        if close is not None:
            close()
        if error is not None:
            stream.error = error
            self.errors.append((stream, error))
        if self.on_leave is not None:
            self.on_leave(stream)

    # ------------------------------------------------------------------ hops
    def hop(self) -> list[StepResult]:
        """One hop of every active stream that has one (a live source yields None while its next
        hop is incomplete; a stream whose source has ended leaves)."""
        taken, hops = [], []
        for stream in list(self.streams):
            try:
                hop = next(stream.hops)
            except StopIteration:
                self.leave(stream)
                continue
            except AudioError as e:
                self.leave(stream, str(e))
                continue
            if hop is None:                  # a live source with no whole hop yet: not this time
                continue
            taken.append(stream)
            hops.append(hop)
            stream.ready_time = getattr(stream.source, "last_ready", None) or time.monotonic()   # a paced source's clock
        self.numbers = []
        if not taken:
            return []
        tokens = self.frontend_batch.push([s.frontend_slot for s in taken], hops)     # HopTokens
        marks = [self._clock()]
        x = self.last_tokens = tokens.tokens.to(self.device, non_blocking=True)               # (S, D)
        probabilities = []
        for name, e in self.entries.items():
            slots = [s.slots[name][s.step % e.spacing] for s in taken]
            probabilities.append(torch.softmax(self.batches[name].step(slots, x).float(), dim=-1))
            marks.append(self._clock())
        host = (torch.cat(probabilities, dim=1).cpu().numpy() if probabilities    # the hop's one wait for the device
                else np.zeros((len(taken), 0), np.float32))
        start = getattr(self.frontend_batch, "network_start", None)
        if self.device.type == "cuda" and start is not None:         # the network's device time, shared
            tokens.network_ms = [self._ms(start, marks[0]) / len(taken)] * len(taken)
            mel_start = getattr(self.frontend_batch, "mel_start", None)
            if mel_start is not None:
                tokens.mel_ms = [self._ms(mel_start, start) / len(taken)] * len(taken)
        answers, column = {}, 0
        for (name, e), a, b in zip(self.entries.items(), marks, marks[1:]):
            width = len(e.classes)
            answers[name] = (host[:, column:column + width], self._ms(a, b) / len(taken))
            column += width
        return self._records(taken, tokens, answers)

    def _clock(self):
        """Now: a CUDA event recorded on the current stream (read after the hop's copy, so no
        wait), or the host clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    @staticmethod
    def _ms(a, b) -> float:
        return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3

    def _records(self, taken: list[Stream], tokens, answers) -> list[StepResult]:
        """A StepResult per stream of the hop (``tokens``: the front end's HopTokens); what is the
        same for every stream, or is read from the batch for all at once, is made once."""
        out, done = [], time.monotonic()
        per_model = []
        for name, (p, latency) in answers.items():
            batch, e = self.batches[name], self.entries[name]
            cfg = e.model.cfg
            fixed = dict(latency_ms=latency, state_bytes=batch.slot_nbytes * e.spacing, trained=e.trained,
                         landmark_mode=batch.mode, spacing=e.spacing, variant=cfg.variant, layers=cfg.layers,
                         window=cfg.window)
            per_model.append((name, list(e.classes), fixed, rounded(p), np.isfinite(p).all(axis=1).tolist(),
                              batch.steps_flops(), batch.landmark_updates(), batch.windows_full()))
        for i, stream in enumerate(taken):
            models = {}
            for name, classes, fixed, rows, finite, flops, updated, warm in per_model:
                if not finite[i]:
                    self.leave(stream, f"{name} answered non-finite probabilities at hop {stream.step}; "
                                       f"this stream stopped")
                    models = None
                    break
                models[name] = ModelStep(probabilities=rows[i], classes=classes, flops=flops[i],
                                         landmark_update=updated[i], warm=warm[i], **fixed)
            if models is None:
                continue
            self.numbers.append(stream.number)
            stats = stream.source.stats
            mel_ms, network_ms = tokens.mel_ms[i], tokens.network_ms[i]
            out.append(StepResult(
                stream.step, (stream.step + 1 + stats.dropped) * HOP_SECONDS, stream.name,
                self.frontend.description, models,
                {"frontend": mel_ms + network_ms, "mel": mel_ms, "network": network_ms, "control": 0.0},
                frontend_flops=tokens.flops[i], dropped_hops=stats.dropped,
                input_rate=int(getattr(stream.source, "input_rate", 0) or 0),
                ready_time=stream.ready_time, done_time=done, mel=tokens.mels[i]))
            stream.step += 1
        return out


def warm_model(model, device, kernels=None) -> None:
    """What initialises on first use runs now, not in a stream's hops: the model steps a scratch
    stream of random tokens through its warm-up and one landmark segment (in the compiled
    backend where ``kernels`` are ready; with None, numba compiles or loads it here)."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    scratch = batch_of(model, 1, kernels)
    if hasattr(scratch, "graphs"):
        scratch.graphs = False
    slot = [scratch.join()]
    with torch.no_grad():
        for _ in range(steps_to_steady(cfg)):
            scratch.step(slot, torch.rand(1, cfg.in_dim, generator=g).to(device))
