"""Many sources in one engine: a stream object per source (its hops, its front-end state, its
position, a slot per phase in every model's batch), and one hop of every active stream at a time,
each model stepped once for all of them (models/stream/batch.py): sherpa-onnx's server loop.

A stream joins at any hop and leaves when its source ends or fails, or when a model answers it
non-finite values: the others go on, and no stream's values depend on which others share the
batch. Each stream's records equal what ``Engine`` gives it alone, within float32 rounding
(tests/app/test_streams.py). The front end is batched too: musicnn takes every stream's new
samples (on CUDA in one copy, framed in one gather there; on the CPU framed stream by stream),
their log-mels in one call on the network's device (the host's values bit for bit,
audio/musicnn/mel.py), then the network once for every stream of
the hop (its continual caches in per-stream slots, audio/musicnn/batch.py); VGGish takes each
stream's log-mel on the host. A hop's per-stream work on the host is its source's next hop and
its record; the records are built from per-model arrays (the batch's FLOPs, landmark events and
warm-up for all streams at once).

The streams may be spread over shards (``StreamsShard``, ``shards=``; `serve` does it on the CPU:
``default_shards``), each a batched engine of its own (its own front-end and model slots, the
weights shared). ``hop()`` steps them one after another; a server steps each shard in a loop and
a thread of its own (app/serve/hub.py's lanes), so that a shard that the event loop's thread
holds up delays only its own streams. `classify` and `bench --streams` keep one engine: stepped
at once, each in its own thread, two shards gave 16 demo streams a p95 of 160-161 ms against
141-143 ms for one engine on two threads, 8 streams 93-111 against 75-84 ms (the slower shard
ended the hop; 2026-11-26, interleaved runs, AMD EPYC). A stream joins the shard with the fewest
streams (or the one it is given); its records do not depend on which.

A record's ``latency_ms`` for a model is the batched step's time divided by the streams in it.
On CUDA a hop waits for the device once, when it copies every model's probabilities back; the
log-mel's, the network's and each model's times are then read from CUDA events recorded between
them (the device's timeline, launch gaps included).
"""
from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from audio.errors import AudioError, FrontEndMismatchError
from audio.frontends import as_frontend
from audio.melspec import HOP, HOP_SECONDS
from models.stream.batch import StreamBatch, steps_to_steady

from .memory import many_streams_heap
from .records import ModelStep, StepResult, rounded


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

    @property
    def name(self) -> str:
        return getattr(self.source, "name", f"stream {self.number}")


class StreamsShard:
    """Every model of ``entries`` (app/runtime/lineup.py) over up to ``capacity`` streams of one
    front end, in one batch per model: ``hop()`` steps them all. ``errors`` (a list, the
    engine's) gets the streams that left early, with why."""

    def __init__(self, frontend, entries, capacity: int, errors: list | None = None):
        self.frontend = as_frontend(frontend)
        self.entries, self.batches = {}, {}
        for e in entries:
            if not hasattr(e.model, "state_dict") or not hasattr(e.model, "blocks"):
                raise ValueError(f"{e.name} is an exported step: it runs one stream; classify its "
                                 f"files one at a time")
            fe = self.frontend
            if (e.frontend is not None and e.frontend != fe.name) or e.model.cfg.in_dim != fe.token_dim:
                raise FrontEndMismatchError(f"{e.name} was trained on {e.frontend} tokens but the streams' "
                                            f"front end is {fe.name}; choose the front end it was trained on")
            self.entries[e.name] = e
            self.batches[e.name] = StreamBatch(e.model.eval(), capacity * e.spacing)
        self.capacity = capacity
        self.frontend_batch = self.frontend.batch(capacity)
        self.device = next((next(e.model.parameters()).device for e in entries), torch.device("cpu"))
        self.streams: list[Stream] = []
        self.errors: list[tuple[Stream, str]] = [] if errors is None else errors
        self.numbers: list[int] = []         # the joining numbers of the last hop's records, in order

    @torch.no_grad()
    def warm(self) -> None:
        """Ready to serve (before any stream joins). What compiles or initialises on first use
        runs now, not in the first streams' hops (the compiled CPU steps compile their kernels on
        a first call, seconds each where numba's cache is cold, as in a fresh Ray Serve replica):
        each model steps a scratch stream of random tokens through its warm-up and one landmark
        segment, and the front end takes two hops of silence in a slot that is then free again.
        Then everything alive in the process leaves the cycle collector's view (``gc.freeze``): a
        full collection walked some 400,000 such objects (130 ms on the CI host, one-off timing),
        and the records of many streams set one off every few dozen hops (`bench --streams` on an
        H200, 256 streams: p95 197 ms before, 75 ms after; the stored run is the after). Cyclic
        garbage alive at the freeze is never collected. And the process's heap is set for many streams
        (app/runtime/memory.py: a hop's temporaries reuse memory, not fresh pages). Nothing of it
        stays in a stream."""
        many_streams_heap()
        g = torch.Generator().manual_seed(0)
        for e in self.entries.values():
            cfg = e.model.cfg
            scratch = StreamBatch(e.model, 1, graphs=False)
            slot = [scratch.join()]
            for _ in range(steps_to_steady(cfg)):
                scratch.step(slot, torch.rand(1, cfg.in_dim, generator=g).to(self.device))
        slot = self.frontend_batch.join()
        for _ in range(2):
            self.frontend_batch.push([slot], [np.zeros(HOP, np.float32)])
        self.frontend_batch.leave(slot)
        gc.freeze()

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
        self.numbers = []
        if not taken:
            return []
        tokens = self.frontend_batch.push([s.frontend_slot for s in taken], hops)     # HopTokens
        marks = [self._clock()]
        x = tokens.tokens.to(self.device, non_blocking=True)                                  # (S, D)
        probabilities = []
        for name, e in self.entries.items():
            slots = [s.slots[name][s.step % e.spacing] for s in taken]
            probabilities.append(torch.softmax(self.batches[name].step(slots, x).float(), dim=-1))
            marks.append(self._clock())
        host = torch.cat(probabilities, dim=1).cpu().numpy()         # the hop's one wait for the device
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
                done_time=done, mel=tokens.mels[i]))
            stream.step += 1
        return out


STREAMS_PER_SHARD = 4       # of capacity, at least, for each shard on the CPU


def default_shards(device: torch.device, capacity: int) -> int:
    """A server's shards (app/serve/hub.py). CPU: one per thread torch may use
    (``torch.get_num_threads()``), at most one per STREAMS_PER_SHARD streams of capacity (with 2
    or 4 streams one engine was faster alone: 30-48 against 34-55 ms a hop); CUDA: one (the
    device does the work)."""
    if device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), capacity // STREAMS_PER_SHARD))


class StreamsEngine:
    """Every model of ``entries`` (app/runtime/lineup.py) over up to ``capacity`` streams of one
    front end, spread over ``shards`` (default one). ``run(sources)`` yields one
    StepResult per stream per hop, streams in joining order; ``errors`` lists the streams that
    left early, with why."""

    def __init__(self, frontend, entries, capacity: int, *, shards: int = 1):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        k = max(1, min(int(shards), capacity))
        self.errors: list[tuple[Stream, str]] = []
        self.shards = [StreamsShard(frontend, entries, capacity // k + (i < capacity % k), self.errors)
                       for i in range(k)]
        first = self.shards[0]
        self.frontend, self.entries, self.device = first.frontend, first.entries, first.device
        self.capacity = capacity
        self._joined, self._numbering = 0, threading.Lock()

    def warm(self) -> None:
        """Each shard ready to serve (``StreamsShard.warm``)."""
        for shard in self.shards:
            shard.warm()

    @property
    def streams(self) -> list[Stream]:
        """The streams, in joining order."""
        if len(self.shards) == 1:
            return self.shards[0].streams
        return sorted((s for shard in self.shards for s in shard.streams), key=lambda s: s.number)

    def place(self, load: list[int] | None = None) -> int:
        """The shard a new stream joins: the one with the fewest streams (``load``: the caller's
        count of each shard's streams, joins in flight included); ValueError when every slot is
        taken."""
        load = [len(shard.streams) for shard in self.shards] if load is None else load
        room = [i for i, shard in enumerate(self.shards) if load[i] < shard.capacity]
        if not room:
            raise ValueError(f"all {self.capacity} streams are taken")
        return min(room, key=lambda i: load[i])

    def join(self, source, shard: int | None = None) -> Stream:
        """A new stream of ``source`` in ``shard`` (default ``place()``); ValueError when it
        is full. Streams of different shards may join from different threads (a server's lanes)."""
        i = self.place() if shard is None else shard
        with self._numbering:
            number = self._joined
            self._joined += 1
        stream = self.shards[i].join(source, number)
        stream.shard = i
        return stream

    def leave(self, stream: Stream, error: str | None = None) -> None:
        self.shards[stream.shard].leave(stream, error)

    def run(self, sources: Iterable) -> Iterator[StepResult]:
        """Every source as a stream, all at once; records in hop order, streams in joining order."""
        for source in sources:
            self.join(source)
        while self.streams:
            yield from self.hop()

    def hop(self) -> list[StepResult]:
        """One hop of every active stream that has one, shard after shard; the records in
        joining order."""
        if len(self.shards) == 1:
            return self.shards[0].hop()
        numbered = []
        for shard in self.shards:
            if shard.streams:
                records = shard.hop()
                numbered += zip(shard.numbers, records)
        numbered.sort(key=lambda x: x[0])
        return [r for _, r in numbered]
