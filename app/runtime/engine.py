"""The streaming engine: source -> front end token (once per hop) -> every model's step.

A plain Python object (no Qt): the CLI, the GUI and the tests drive it the same way. Each hop gives
one ``StepResult`` (app/runtime/records.py) with every model's probabilities, FLOPs, latency and
state memory.

Models can be added, removed, reset and switched between continual and fixed landmarks while the
stream runs: the control methods are safe to call from any thread and are applied in call order by
the processing thread between hops (so the hot path needs no locks). Control has a budget, so that
it never makes a live stream drop a hop: the heavy part of a request (building a model's slot, the
k-means fit of live landmarks, 0.2-0.7 s for a paper-sized model) runs on a control thread while hops go on, and the
requests applied before one hop take at most ``CONTROL_BUDGET_MS`` (the rest wait for the next
hop). A stream that is not live (a file read as fast as possible) applies every request before
the next hop. The engine never blocks the capture thread: sources drop whole hops when processing
falls behind (counted in ``source.stats.dropped``, reported in every StepResult).
"""
from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections import deque
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from audio.errors import FrontEndMismatchError
from audio.frontends import FrontEnd, as_frontend
from audio.gtzan import GENRES
from audio.tokens.stream import TokenStream
from models.fused import default_fused
from models.interleaved import InterleavedStreams
from models.landmarks import fit_fixed_landmarks
from models.sda import LANDMARK_MODES
from models.transformer import build_model

from .lineup import ModelSpec
from .records import ModelStep, StepResult, rounded

CONTROL_BUDGET_MS = 20.0      # control requests applied before one live hop (of 250 ms) take at most this


def device_of(model) -> torch.device:
    """Where ``model`` computes: its first parameter's or buffer's device (the CPU for an
    exported step, app/runtime/onnx_step.py)."""
    for t in itertools.chain(model.parameters(), model.buffers()):     # the first one only
        return t.device
    return torch.device("cpu")


@dataclass
class Slot:
    model: torch.nn.Module       # a GenreTransformer, or InterleavedStreams of one
    trained: bool                # weights from a trained checkpoint
    spacing: int = 1             # hops between the tokens the model is fed
    classes: tuple[str, ...] = GENRES   # class names (a checkpoint's own)
    device: torch.device = torch.device("cpu")   # where the model computes (its tokens go there)


class NonFiniteOutputError(ArithmeticError):
    """A model answered NaN or infinity: an error, never a record (its weights or input are broken)."""


class EngineError(ValueError):
    """A control request that cannot be honoured (unknown model, no landmarks, ...)."""


class Engine:
    """Runs every model on the tokens of one source and one front end (computed once per hop).

    ``frontend``: a FrontEnd (or a VGGish Embedder); ``models``: name -> GenreTransformer;
    ``trained``: name -> bool; ``spacing``: name -> hops between the tokens the model was trained
    on (default 1), fed as interleaved streams; ``fused``: step continual models in the compiled
    CPU kernel (default; False: the torch reference path); ``frontends``: name -> the front-end name a model
    was trained on (a mismatch is refused); ``classes``: name -> its class names (default GTZAN);
    ``clock``: the seconds clock that the control budget is counted on.

    Each StepResult's ``stages['control']`` is the engine's own record of the milliseconds spent
    applying control requests before that hop (on ``clock``).
    """

    def __init__(self, frontend: FrontEnd, models: dict | None = None,
                 trained: dict[str, bool] | None = None, *, spacing: dict[str, int] | None = None,
                 frontends: dict[str, str] | None = None, classes: dict | None = None,
                 recent_tokens: int = 480, fused: bool = True, clock=time.perf_counter):
        self.clock = clock      # seconds; the control budget's clock (tests inject one)
        self.frontend = as_frontend(frontend)
        self.fused = fused      # the compiled CPU step where it applies (models/fused/)
        self.slots: dict[str, Slot] = {}
        for name, model in (models or {}).items():
            self.slots[name] = self._slot(name, model, (trained or {}).get(name, False),
                                          (spacing or {}).get(name, 1), (frontends or {}).get(name),
                                          (classes or {}).get(name))
        self._ops: queue.SimpleQueue = queue.SimpleQueue()   # control requests, in call order
        self._job: Future | None = None     # a request's heavy part, on the control thread
        self._control = ThreadPoolExecutor(1, thread_name_prefix="engine-control")
        self._recent: deque = deque(maxlen=recent_tokens)   # recent tokens, for live-fitted landmarks
        self._stop = threading.Event()
        self.control_ms = 0.0       # time the last apply_pending took (ms, on ``clock``)

    @property
    def models(self) -> dict:
        return {name: s.model for name, s in self.slots.items()}

    @classmethod
    def from_lineup(cls, frontend: FrontEnd, entries) -> "Engine":
        """An engine running ``entries`` (app/runtime/lineup.py Entry objects)."""
        return cls(frontend, {e.name: e.model for e in entries}, {e.name: e.trained for e in entries},
                   spacing={e.name: e.spacing for e in entries},
                   frontends={e.name: e.frontend for e in entries if e.frontend},
                   classes={e.name: e.classes for e in entries})

    def _slot(self, name: str, model, trained: bool, spacing: int, frontend: str | None,
              classes=None) -> Slot:
        fe = self.frontend
        if (frontend is not None and frontend != fe.name) or model.cfg.in_dim != fe.token_dim:
            raise FrontEndMismatchError(
                f"{name} was trained on {frontend or f'{model.cfg.in_dim}-d'} tokens but this stream's "
                f"front end is {fe.name} ({fe.token_dim}-d); choose the front end it was trained on")
        classes = tuple(classes or GENRES)
        if len(classes) != model.cfg.num_classes:
            raise EngineError(f"{name} has {model.cfg.num_classes} outputs but {len(classes)} class names")
        if spacing > 1:
            model = InterleavedStreams(model, spacing)
        device = device_of(model)
        model.use_fused(self.fused and default_fused(device))
        return Slot(model.eval(), trained, spacing, classes, device)

    # ------------------------------------------------------------------ control (any thread)
    def add_model(self, name: str, model, trained: bool = False, *, spacing: int | None = 1,
                  frontend: str | None = None, classes=None) -> None:
        """Start running ``model`` from the next hop (its window fills from there). ``model``: a
        GenreTransformer, or a ModelSpec built on the control thread; ``spacing`` None: the front
        end's native spacing."""
        self._ops.put(("add", name, (model, trained, spacing, frontend, classes)))

    def remove_model(self, name: str) -> None:
        self._ops.put(("remove", name, None))

    def reset_model(self, name: str | None = None) -> None:
        """Empty the streaming state of one model (or all with None)."""
        self._ops.put(("reset", name, None))

    def set_landmark_mode(self, name: str, mode: str) -> None:
        """'continual' or 'fixed', live. An untrained model gets fixed landmarks by k-means of
        its Q/K on the recent stream tokens (the paper's phase-2 fit, without fine-tuning)."""
        self._ops.put(("mode", name, mode))

    def use_fixed_landmarks(self, on: bool) -> None:
        """Switch every Nyström model (those added before this call included) to fixed landmarks,
        or back to the mode it came with (a trained fixed-landmark model stays fixed; others
        return to their variant's default, 'continual' / 'segment'), live."""
        self._ops.put(("fixed_all", None, on))

    def stop(self) -> None:
        """End ``run`` after the hop in progress (close the source too, to stop waiting on it)."""
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
            if name in self.slots:
                raise EngineError(f"a model named {name!r} is already running")
            return self._off_thread(lambda: self._ready_slot(name, arg), lambda slot: self._install(name, slot))
        if name is not None and name not in self.slots:
            raise EngineError(f"no model named {name!r}")
        if op == "remove":
            del self.slots[name]
            return [f"removed {name}"]
        if op == "reset":
            for n in ([name] if name else list(self.slots)):
                self.slots[n].model.reset(1)
            return [f"reset {name or 'all models'}"]
        if op == "fixed_all":
            targets = {n: "fixed" if arg else slot.model.cfg.home_landmark_mode
                       for n, slot in self.slots.items()
                       if slot.model.cfg.nystrom and getattr(slot.model, "switchable", True)}
            if not targets:
                return ["no Nyström model to switch"]
        else:
            self._check_mode(name, self.slots[name].model, arg)
            targets = {name: arg}
        to_fit = {n: self.slots[n].model for n, mode in targets.items()
                  if mode == "fixed" and not self.slots[n].model.has_fixed_landmarks}
        if not to_fit:
            return [self._switch(n, mode) for n, mode in targets.items()]
        recent = list(self._recent)
        if op != "fixed_all" and len(recent) < to_fit[name].cfg.num_landmarks:
            raise EngineError(self._too_few(to_fit[name]))

        def fits():
            return {n: self._fit_live(model, recent) for n, model in to_fit.items()
                    if len(recent) >= model.cfg.num_landmarks}
        return self._off_thread(fits, lambda fitted: self._install_landmarks(targets, to_fit, fitted, len(recent)))

    def _ready_slot(self, name: str, arg) -> Slot:
        """(control thread) The slot of a model to add, reset for a new stream."""
        model, trained, spacing, frontend, classes = arg
        if isinstance(model, ModelSpec):
            model = model.build(self.frontend.name)      # CheckpointError is a ValueError: said
        if spacing is None:
            spacing = self.frontend.native_spacing
        try:
            slot = self._slot(name, model, trained, spacing, frontend, classes)
        except FrontEndMismatchError as e:
            raise EngineError(str(e)) from e
        slot.model.reset(1)
        return slot

    def _install(self, name: str, slot: Slot) -> list[str]:
        if name in self.slots:
            raise EngineError(f"a model named {name!r} is already running")
        self.slots[name] = slot
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
        self.slots[name].model.set_landmark_mode(mode)
        return f"{name}: {mode} landmarks{note}"

    def _install_landmarks(self, targets: dict, to_fit: dict, fitted: dict, tokens: int) -> list[str]:
        """(processing thread) Install fitted landmarks, then switch every target's mode."""
        lines = []
        for n, mode in targets.items():
            slot = self.slots.get(n)
            if slot is None or (n in to_fit and slot.model is not to_fit[n]):
                lines.append(f"error: {n} was removed before its landmarks were fitted")
                continue
            note = ""
            if n in to_fit:
                if n not in fitted:
                    lines.append(f"error: {self._too_few(slot.model)}")
                    continue
                for block, (q, k) in zip(getattr(slot.model, "primary", slot.model).blocks, fitted[n]):
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
        primary = getattr(model, "primary", model)
        device = device_of(primary)
        twin = build_model(primary.cfg).to(device)
        twin.load_state_dict(primary.state_dict())
        n = primary.cfg.window
        tokens = torch.stack(recent).to(device)                              # (R, in_dim)
        chunks = [tokens[i:i + n] for i in range(0, len(tokens), n)]
        groups = [torch.stack(chunks[:-1])] if len(chunks) > 1 else []
        groups.append(chunks[-1][None])
        fit_fixed_landmarks(twin, groups, seed=0)
        return [(b.attn.fixed_q_land.clone(), b.attn.fixed_k_land.clone()) for b in twin.blocks]

    # ------------------------------------------------------------------ streaming
    def run(self, source):
        """Yield one StepResult per hop of ``source`` until it ends or ``stop()``."""
        self._stop.clear()
        live = getattr(source, "realtime", True)      # a live source drops hops if we fall behind
        events = self.apply_pending()
        for slot in self.slots.values():
            slot.model.eval()
            slot.model.reset(1)
        control_ms = self.control_ms
        for item in TokenStream(source, self.frontend):
            events += self.apply_pending(wait=not live)
            control_ms += self.control_ms
            if self._stop.is_set():
                return
            token = item.token.detach().cpu()
            self._recent.append(token[0])
            result = self._step(item, token, source, events, control_ms)
            events, control_ms = [], 0.0
            yield result

    def _step(self, item, token, source, events, control_ms: float) -> StepResult:
        models = {}
        for name, slot in self.slots.items():
            model = slot.model
            t0 = time.perf_counter()
            logits = model.step(token.to(slot.device))
            p = torch.softmax(logits[0].float(), dim=-1).cpu()      # .cpu() waits for CUDA
            latency = (time.perf_counter() - t0) * 1e3
            probabilities = rounded(p.numpy())
            if not all(map(math.isfinite, probabilities)):
                raise NonFiniteOutputError(f"{name} answered non-finite probabilities at hop {item.index} "
                                           f"({item.audio_time:.2f} s); processing stopped")
            cfg = model.cfg
            models[name] = ModelStep(
                probabilities=probabilities, classes=list(slot.classes),
                flops=model.step_flops(), latency_ms=latency, state_bytes=model.state_nbytes(),
                trained=slot.trained, landmark_mode=model.landmark_mode,
                landmark_update=model.landmark_updated(), warm=model.window_full(), spacing=slot.spacing,
                variant=cfg.variant, layers=cfg.layers, window=cfg.window)
        return StepResult(item.index, item.audio_time, source.name, self.frontend.description, models,
                          {"frontend": item.mel_ms + item.network_ms, "mel": item.mel_ms,
                           "network": item.network_ms, "control": control_ms},
                          frontend_flops=item.flops, dropped_hops=source.stats.dropped,
                          input_rate=int(getattr(source, "input_rate", 0) or 0),
                          ready_time=item.ready_time, done_time=time.monotonic(), events=events,
                          mel=item.mel)
