"""The streaming engine: every source (a file, the microphone, a network client, the demo) is a
stream in a slot of batched state, and one stream is simply a batch of one. A hop runs the front
end and every model once for all streams that have audio (app/runtime/shard.py), and each
stream's records equal what it gets alone. A plain Python object (no Qt): `classify`, `serve`,
the window's engine process, the benches and the tests drive it the same way.

The streams may be spread over shards (``shards=``; `serve` does it on the CPU:
``default_shards``), each a batched engine of its own (its own front-end and model slots, the
weights shared). ``hop()`` steps them one after another; a server steps each shard in a loop and
a thread of its own (app/serve/hub.py's lanes), so that a shard that the event loop's thread
holds up delays only its own streams. A stream joins the shard with the fewest streams (or the
one it is given); its records do not depend on which.

Live control: models are added, removed, reset and switched between continual and fixed
landmarks while streams run, each for all its streams. The control methods are safe to call
from any thread and are applied in call order between hops (so the hot path needs no locks).
Control has a budget, so that it never makes a live stream drop a hop: the heavy part of a
request (building and warming a model's batches, the k-means fit of live landmarks, 0.2-0.7 s
for a paper-sized model) runs on a control thread while hops go on, and the requests applied
before one hop take at most ``CONTROL_BUDGET_MS`` (the rest wait for the next hop). Streams that
are not live (files read as fast as possible) apply every request before the next hop. The
engine never blocks a capture thread: sources drop whole hops when processing falls behind
(``source.stats.dropped``, in every StepResult).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from audio.errors import FrontEndMismatchError
from audio.frontends import as_frontend
from audio.gtzan import GENRES
from models.landmarks import fit_fixed_landmarks
from models.sda import LANDMARK_MODES
from models.transformer import build_model

from .kernels import KERNELS
from .lineup import Entry, ModelSpec
from .records import StepResult
from .shard import Stream, StreamsShard, check_frontend, warm_model

CONTROL_BUDGET_MS = 20.0      # control requests applied before one live hop (of 250 ms) take at most this
STREAMS_PER_SHARD = 4         # of capacity, at least, for each shard on the CPU


class EngineError(ValueError):
    """A control request that cannot be honoured (unknown model, no landmarks, ...)."""


def default_shards(device: torch.device, capacity: int) -> int:
    """A server's shards (app/serve/hub.py). CPU: one per thread torch may use
    (``torch.get_num_threads()``), at most one per STREAMS_PER_SHARD streams of capacity (a few
    streams run faster in one: docs/benchmarks.md, design measurements); CUDA: one (the device
    does the work)."""
    if device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), capacity // STREAMS_PER_SHARD))


class Engine:
    """Every model of ``entries`` (app/runtime/lineup.py Entry objects) over up to ``capacity``
    streams of one front end, spread over ``shards`` (default one). ``run(sources)`` yields one
    StepResult per stream per hop, streams in joining order; ``errors`` lists the streams that
    left early, with why; ``on_leave(stream)``, if set, hears each stream that leaves, after its
    last record (its source closed, ``stream.error`` set if it left early). ``clock``: the
    seconds clock that the control budget is counted on
    (tests inject one); each StepResult's ``stages['control']`` is the milliseconds spent
    applying control before its hop. ``kernels``: the models' compiled CPU kernels
    (app/runtime/kernels.py): asked for by each model's batch (loaded then where cached, else built
    beside the hops), taken from the first hop after they are ready, the torch step until then
    (None: numba compiles them on their first call)."""

    def __init__(self, frontend, entries: Iterable[Entry] = (), capacity: int = 1, *, shards: int = 1,
                 clock=time.perf_counter, recent_tokens: int = 480, kernels=KERNELS):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.frontend = as_frontend(frontend)
        entries = list(entries)
        for e in entries:
            self._check(e)
        k = max(1, min(int(shards), capacity))
        self.errors: list[tuple[Stream, str]] = []
        self.kernels = kernels
        self.shards = [StreamsShard(self.frontend, entries, capacity // k + (i < capacity % k), self.errors, kernels)
                       for i in range(k)]
        self.entries = {e.name: e for e in entries}
        self.device, self.capacity = self.shards[0].device, capacity
        self._joined, self._numbering = 0, threading.Lock()
        self.clock = clock
        self._ops: queue.SimpleQueue = queue.SimpleQueue()     # control requests, in call order
        self._job: Future | None = None                         # a request's heavy part, on the control thread
        self._control = ThreadPoolExecutor(1, thread_name_prefix="engine-control")
        self._recent: deque = deque(maxlen=recent_tokens)       # recent tokens, for live-fitted landmarks
        self._stop = threading.Event()
        self.control_ms = 0.0                                   # what the last apply_pending took (ms)

    @property
    def on_leave(self):
        return self.shards[0].on_leave

    @on_leave.setter
    def on_leave(self, callback) -> None:
        for shard in self.shards:
            shard.on_leave = callback

    @classmethod
    def from_lineup(cls, frontend, entries: Iterable[Entry]) -> "Engine":
        """An engine for one stream of ``entries`` (what the window and ``classify FILE`` run)."""
        return cls(frontend, entries)

    @property
    def models(self) -> dict:
        return {name: e.model for name, e in self.entries.items()}

    def _check(self, entry: Entry) -> None:
        check_frontend(entry, self.frontend)
        if not isinstance(entry.spacing, int) or entry.spacing < 1:
            raise EngineError(f"{entry.name}: spacing must be >= 1 hop, got {entry.spacing!r}")
        if len(entry.classes) != entry.model.cfg.num_classes:
            raise EngineError(f"{entry.name} has {entry.model.cfg.num_classes} outputs but "
                              f"{len(entry.classes)} class names")

    def warm(self) -> None:
        """Each shard ready to serve (``StreamsShard.warm``): before the first hop, what
        initialises on first use has."""
        for shard in self.shards:
            shard.warm()

    # ------------------------------------------------------------------ streams
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

    def run(self, sources: Iterable, *, more: Iterator | None = None, warm: bool = False) -> Iterator[StepResult]:
        """Every source (or one) as a stream, all at once, until they end or ``stop()``; records in hop
        order, streams in joining order. Control requests are applied before every hop (within
        the budget when a source is live). ``more``: sources to join as others leave, one each
        (bounded work over many files). ``warm``: ``warm()`` before the first hop (after the
        models queued so far are added)."""
        self._stop.clear()
        sources = [sources] if hasattr(sources, "stats") else list(sources)     # one source, or many
        live = any(getattr(s, "realtime", True) for s in sources)
        events = self.apply_pending()
        control_ms = self.control_ms
        if warm:
            self.warm()
        for source in sources:
            self.join(source)
        while self.streams and not self._stop.is_set():
            records = self.hop()
            if records:
                tokens = getattr(self.shards[0], "last_tokens", None)
                if tokens is not None and len(tokens):
                    self._recent.append(tokens[0].detach().cpu())
                for r in records:
                    r.events, r.stages["control"] = events, control_ms
                events, control_ms = [], 0.0
                yield from records
            if more is not None:
                while len(self.streams) < self.capacity:
                    source = next(more, None)
                    if source is None:
                        more = None
                        break
                    self.join(source)
            events += self.apply_pending(wait=not live)
            control_ms += self.control_ms

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

    # ------------------------------------------------------------------ control (any thread)
    def add_model(self, name: str, model, trained: bool = False, *, spacing: int | None = 1,
                  frontend: str | None = None, classes=None) -> None:
        """Start running ``model`` for every stream from the next hop (its windows fill from
        there). ``model``: a GenreTransformer, or a ModelSpec built on the control thread;
        ``spacing`` None: the front end's native spacing."""
        self._ops.put(("add", name, (model, trained, spacing, frontend, classes)))

    def remove_model(self, name: str) -> None:
        self._ops.put(("remove", name, None))

    def reset_model(self, name: str | None = None) -> None:
        """Empty the streaming state of one model (or all with None) for every stream."""
        self._ops.put(("reset", name, None))

    def set_landmark_mode(self, name: str, mode: str) -> None:
        """'continual' or 'fixed', live, for all of the model's streams. An untrained model gets
        fixed landmarks by k-means of its Q/K on the recent stream tokens (the paper's phase-2
        fit, without fine-tuning)."""
        self._ops.put(("mode", name, mode))

    def use_fixed_landmarks(self, on: bool) -> None:
        """Switch every Nyström model (those added before this call included) to fixed landmarks,
        or back to the mode it came with (a trained fixed-landmark model stays fixed; others
        return to their variant's default), live."""
        self._ops.put(("fixed_all", None, on))

    def stop(self) -> None:
        """End ``run`` after the hop in progress (close a live source too, to stop waiting on it)."""
        self._stop.set()

    def apply_pending(self, wait: bool = True) -> list[str]:
        """Apply queued control requests; returns what happened (also errors), one line each.

        ``wait=False`` (between live hops): no new request starts once ``CONTROL_BUDGET_MS`` are
        spent, and a request whose heavy part is still running on the control thread when they
        are holds back the requests after it; the rest are applied before later hops."""
        t0 = self.clock()
        try:
            return self._apply_within_budget(wait, t0)
        finally:
            self.control_ms = (self.clock() - t0) * 1e3

    def _apply_within_budget(self, wait: bool, t0: float) -> list[str]:
        events = []
        while True:
            left_s = CONTROL_BUDGET_MS / 1e3 - (self.clock() - t0)
            if self._job is not None:        # a quick job (a model build) is waited for within budget
                futures.wait([self._job], timeout=None if wait else max(0.0, left_s))
                if not self._job.done():
                    return events
                job, self._job = self._job, None
                events += self._guarded(lambda: job.result()())      # the job's finish, here
                continue
            if not wait and left_s < 0:
                return events
            try:
                op, name, arg = self._ops.get_nowait()
            except queue.Empty:
                return events
            out = self._guarded(lambda: self._apply(op, name, arg))
            if isinstance(out, Future):
                self._job = out
            else:
                events += out

    @staticmethod
    def _guarded(action) -> list[str] | Future:
        try:
            return action()
        except (EngineError, ValueError) as e:     # FrontEndMismatchError is a ValueError
            return [f"error: {e}"]

    def _off_thread(self, work, finish) -> Future:
        """Run ``work()`` on the control thread; its result goes to ``finish`` (-> events),
        called on the processing thread by ``apply_pending``."""
        def prepared():
            value = work()
            return lambda: finish(value)
        return self._control.submit(prepared)

    def _apply(self, op: str, name: str | None, arg) -> list[str] | Future:
        if op == "add":
            if name in self.entries:
                raise EngineError(f"a model named {name!r} is already running")
            return self._off_thread(lambda: self._ready(name, arg), lambda ready: self._install(name, *ready))
        if name is not None and name not in self.entries:
            raise EngineError(f"no model named {name!r}")
        if op == "remove":
            del self.entries[name]
            for shard in self.shards:
                shard.remove_model(name)
            return [f"removed {name}"]
        if op == "reset":
            for n in ([name] if name else list(self.entries)):
                for shard in self.shards:
                    shard.reset_model(n)
            return [f"reset {name or 'all models'}"]
        if op == "fixed_all":
            targets = {n: "fixed" if arg else e.model.cfg.home_landmark_mode for n, e in self.entries.items()
                       if e.model.cfg.nystrom and getattr(e.model, "switchable", True)}
            if not targets:
                return ["no Nyström model to switch"]
        else:
            self._check_mode(name, self.entries[name].model, arg)
            targets = {name: arg}
        to_fit = {n: self.entries[n].model for n, mode in targets.items()
                  if mode == "fixed" and not self.entries[n].model.has_fixed_landmarks}
        if not to_fit:
            return [self._switch(n, mode) for n, mode in targets.items()]
        recent = list(self._recent)
        if op != "fixed_all" and len(recent) < to_fit[name].cfg.num_landmarks:
            raise EngineError(self._too_few(to_fit[name]))

        def fits():
            return {n: self._fit_live(model, recent) for n, model in to_fit.items()
                    if len(recent) >= model.cfg.num_landmarks}
        return self._off_thread(fits, lambda fitted: self._install_landmarks(targets, to_fit, fitted, len(recent)))

    def _ready(self, name: str, arg) -> tuple[Entry, list]:
        """(control thread) The entry of a model to add and its batch for every shard, warmed."""
        model, trained, spacing, frontend, classes = arg
        if isinstance(model, ModelSpec):
            model = model.build(self.frontend.name)      # CheckpointError is a ValueError: said
        if spacing is None:
            spacing = self.frontend.native_spacing
        entry = Entry(name, model.eval(), trained, spacing, frontend, classes=tuple(classes or GENRES))
        try:
            self._check(entry)
            batches = [shard.batches_for(entry) for shard in self.shards]
        except FrontEndMismatchError as e:
            raise EngineError(str(e)) from e
        if self.streams:                                 # streams run: it warms here, not in their hops
            warm_model(model, self.device, self.kernels)
        return entry, batches

    def _install(self, name: str, entry: Entry, batches: list) -> list[str]:
        if name in self.entries:
            raise EngineError(f"a model named {name!r} is already running")
        self.entries[name] = entry
        for shard, batch in zip(self.shards, batches):
            shard.add_model(entry, batch)
        return [f"added {name}"]

    def _check_mode(self, name: str, model, mode: str) -> None:
        cfg = model.cfg
        if not cfg.nystrom:
            raise EngineError(f"{name} ({cfg.variant}) has no landmarks")
        if not getattr(model, "switchable", True):
            raise EngineError(f"{name} is an exported graph: it keeps the {model.landmark_mode} "
                              f"landmarks it was exported with")
        if mode not in LANDMARK_MODES[cfg.variant]:
            raise EngineError(f"landmark mode {mode!r} is not one of {LANDMARK_MODES[cfg.variant]}")

    def _switch(self, name: str, mode: str, note: str = "") -> str:
        self.entries[name].model.set_landmark_mode(mode)
        for shard in self.shards:
            shard.set_landmark_mode(name)
        return f"{name}: {mode} landmarks{note}"

    def _install_landmarks(self, targets: dict, to_fit: dict, fitted: dict, tokens: int) -> list[str]:
        """(processing thread) Install fitted landmarks, then switch every target's mode."""
        lines = []
        for n, mode in targets.items():
            entry = self.entries.get(n)
            if entry is None or (n in to_fit and entry.model is not to_fit[n]):
                lines.append(f"error: {n} was removed before its landmarks were fitted")
                continue
            note = ""
            if n in to_fit:
                if n not in fitted:
                    lines.append(f"error: {self._too_few(entry.model)}")
                    continue
                for block, (q, k) in zip(entry.model.blocks, fitted[n]):
                    block.attn.set_fixed_landmarks(q, k)
                note = f" (landmarks fitted by k-means on the last {tokens} stream tokens)"
            lines.append(self._switch(n, mode, note))
        return lines

    @staticmethod
    def _too_few(model) -> str:
        return (f"fixed landmarks for an untrained model are fitted on the stream; "
                f"wait for at least {model.cfg.num_landmarks} tokens")

    @staticmethod
    def _fit_live(model, recent: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(control thread) k-means landmarks of ``model`` on the ``recent`` tokens, per block
        (q, k) each (heads, m, d_head), fitted on a copy: the live model keeps streaming."""
        device = model.embed.weight.device
        twin = build_model(model.cfg).to(device)
        twin.load_state_dict(model.state_dict())
        n = model.cfg.window
        tokens = torch.stack(recent).to(device)                              # (R, in_dim)
        chunks = [tokens[i:i + n] for i in range(0, len(tokens), n)]
        groups = [torch.stack(chunks[:-1])] if len(chunks) > 1 else []
        groups.append(chunks[-1][None])
        fit_fixed_landmarks(twin, groups, seed=0)
        return [(b.attn.fixed_q_land.clone(), b.attn.fixed_k_land.clone()) for b in twin.blocks]
