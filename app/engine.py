"""The streaming engine: source -> front end token (once per hop) -> every model's step.

A plain Python object (no Qt): the CLI, the GUI and the tests drive it the same way. Each hop gives
one ``StepResult`` with the probabilities, FLOPs, latency and state memory of every model.

Models can be added, removed, reset and switched between continual and fixed landmarks while the
stream runs: the control methods are safe to call from any thread and take effect before the next
hop (the processing thread applies them, so the hot path needs no locks). The engine never blocks
the capture thread: sources drop whole hops when processing falls behind (counted in
``source.stats.dropped``, reported in every StepResult).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from audio.gtzan import GENRES
from audio.errors import FrontEndMismatchError
from audio.frontends import FrontEnd, as_frontend
from audio.tokens import TokenStream
from models.interleaved import InterleavedStreams
from models.landmarks import fit_fixed_landmarks
from models.sda import LANDMARK_MODES


@dataclass
class StepResult:
    step: int                                   # hop / token index
    audio_time: float                           # seconds of audio up to the end of this hop
    source: str
    frontend: str                               # which front end (and weights) made the token
    probabilities: dict[str, list[float]]       # model -> 10 genre probabilities
    top: dict[str, tuple[str, float]]           # model -> (genre, probability)
    flops: dict[str, dict[str, int]]            # model -> {'sda', 'attention', 'model'} this step
    latency_ms: dict[str, float]                # 'frontend' (= 'mel' + 'network'), one per model
    state_bytes: dict[str, int]                 # model -> streaming state size
    untrained: dict[str, bool]                  # model -> no trained checkpoint loaded
    landmark_mode: dict[str, str | None]        # model -> 'continual' / 'fixed' / None
    dropped_hops: int = 0                       # hops the source dropped so far
    ready_time: float = 0.0                     # time.monotonic() when the hop's last sample arrived
    done_time: float = 0.0                      # time.monotonic() when every model had stepped
    events: list[str] = field(default_factory=list)   # control changes applied before this hop
    frontend_flops: int = 0                     # FLOPs of the front-end network for this hop
    spacing: dict[str, int] = field(default_factory=dict)   # model -> hops between its tokens
    mel: np.ndarray | None = field(default=None, repr=False)   # (k, bands) this hop's log-mel frames

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("mel")
        return d


@dataclass
class Slot:
    model: torch.nn.Module       # a GenreTransformer, or InterleavedStreams of one
    trained: bool                # weights from a trained checkpoint
    spacing: int = 1             # hops between the tokens the model is fed
    home_mode: str | None = None  # landmark mode the model came with (None: its variant's default)


class EngineError(ValueError):
    """A control request that cannot be honoured (unknown model, no landmarks, ...)."""


class Engine:
    """Runs every model on the tokens of one source and one front end (computed once per hop).

    ``frontend``: a FrontEnd (or a VGGish Embedder); ``models``: name -> GenreTransformer;
    ``trained``: name -> bool; ``spacing``: name -> hops between the tokens the model was trained
    on (default 1), fed as interleaved streams; ``frontends``: name -> the front-end name a model
    was trained on (a mismatch is refused).
    """

    def __init__(self, frontend: FrontEnd, models: dict | None = None,
                 trained: dict[str, bool] | None = None, *, spacing: dict[str, int] | None = None,
                 frontends: dict[str, str] | None = None, recent_tokens: int = 480):
        self.frontend = as_frontend(frontend)
        self.slots: dict[str, Slot] = {}
        for name, model in (models or {}).items():
            self.slots[name] = self._slot(name, model, (trained or {}).get(name, False),
                                          (spacing or {}).get(name, 1), (frontends or {}).get(name))
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._recent: deque = deque(maxlen=recent_tokens)   # recent tokens, for live-fitted landmarks
        self._stop = threading.Event()
        self._running = False

    @property
    def models(self) -> dict:
        return {name: s.model for name, s in self.slots.items()}

    def _slot(self, name: str, model, trained: bool, spacing: int, frontend: str | None) -> Slot:
        fe = self.frontend
        if (frontend is not None and frontend != fe.name) or model.cfg.in_dim != fe.token_dim:
            raise FrontEndMismatchError(
                f"{name} was trained on {frontend or f'{model.cfg.in_dim}-d'} tokens but this stream's "
                f"front end is {fe.name} ({fe.token_dim}-d); choose the front end it was trained on")
        if spacing > 1:
            model = InterleavedStreams(model, spacing)
        return Slot(model.eval(), trained, spacing, model.cfg.landmark_mode)

    # ------------------------------------------------------------------ control (any thread)
    def add_model(self, name: str, model, trained: bool = False, *, spacing: int = 1,
                  frontend: str | None = None) -> None:
        """Start running ``model`` from the next hop (its window fills from there)."""
        self._ops.put(("add", name, (model, trained, spacing, frontend)))

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

    def apply_pending(self) -> list[str]:
        """Apply queued control requests now; returns what happened (also errors), one line each."""
        events = []
        while True:
            try:
                op, name, arg = self._ops.get_nowait()
            except queue.Empty:
                return events
            try:
                events += self._apply(op, name, arg)
            except (EngineError, ValueError) as e:
                events.append(f"error: {e}")

    def _apply(self, op: str, name: str | None, arg) -> list[str]:
        if op == "add":
            model, trained, spacing, frontend = arg
            if name in self.slots:
                raise EngineError(f"a model named {name!r} is already running")
            try:
                self.slots[name] = slot = self._slot(name, model, trained, spacing, frontend)
            except FrontEndMismatchError as e:
                raise EngineError(str(e)) from e
            if self._running:
                slot.model.reset(1)
            return [f"added {name}"]
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
            lines = []
            for n, slot in self.slots.items():
                if slot.model.cfg.nystrom:
                    mode = "fixed" if arg else (slot.home_mode or LANDMARK_MODES[slot.model.cfg.variant][0])
                    try:
                        lines.append(self._set_mode(n, slot.model, mode))
                    except EngineError as e:
                        lines.append(f"error: {e}")
            return lines or ["no Nyström model to switch"]
        return [self._set_mode(name, self.slots[name].model, arg)]

    def _set_mode(self, name: str, model, mode: str) -> str:
        cfg = model.cfg
        if not cfg.nystrom:
            raise EngineError(f"{name} ({cfg.variant}) has no landmarks")
        if mode not in LANDMARK_MODES[cfg.variant]:
            raise EngineError(f"landmark mode {mode!r} is not one of {LANDMARK_MODES[cfg.variant]}")
        note = ""
        if mode == "fixed" and not bool(model.blocks[0].attn.has_fixed):
            self._fit_live(model)
            note = f" (landmarks fitted by k-means on the last {len(self._recent)} stream tokens)"
        model.set_landmark_mode(mode)
        return f"{name}: {mode} landmarks{note}"

    def _fit_live(self, model) -> None:
        n, m = model.cfg.window, model.cfg.num_landmarks
        if len(self._recent) < m:
            raise EngineError(f"fixed landmarks for an untrained model are fitted on the stream; "
                              f"wait for at least {m} tokens")
        tokens = torch.stack(list(self._recent)).to(model.embed.weight.device)   # (R, in_dim)
        chunks = [tokens[i:i + n] for i in range(0, len(tokens), n)]
        groups = [torch.stack(chunks[:-1])] if len(chunks) > 1 else []
        groups.append(chunks[-1][None])
        fit_fixed_landmarks(getattr(model, "primary", model), groups, seed=0)   # installs them

    # ------------------------------------------------------------------ streaming
    def run(self, source):
        """Yield one StepResult per hop of ``source`` until it ends or ``stop()``."""
        self._stop.clear()
        events = self.apply_pending()
        for slot in self.slots.values():
            slot.model.eval()
            slot.model.reset(1)
        self._running = True
        try:
            for item in TokenStream(source, self.frontend):
                events += self.apply_pending()
                if self._stop.is_set():
                    return
                token = item.token.detach().cpu()
                self._recent.append(token[0])
                result = self._step(item, token, source, events)
                events = []
                yield result
        finally:
            self._running = False

    def _step(self, item, token, source, events) -> StepResult:
        probabilities, top, flops, memory, modes = {}, {}, {}, {}, {}
        latency = {"frontend": item.mel_ms + item.network_ms, "mel": item.mel_ms,
                   "network": item.network_ms}
        for name, slot in self.slots.items():
            model = slot.model
            t0 = time.perf_counter()
            logits = model.step(token.to(model.embed.weight.device))
            p = torch.softmax(logits[0].float(), dim=-1).cpu()      # .cpu() waits for CUDA
            latency[name] = (time.perf_counter() - t0) * 1e3
            probabilities[name] = [round(x, 6) for x in p.tolist()]
            best = int(p.argmax())
            top[name] = (GENRES[best], float(p[best]))
            flops[name] = model.step_flops()
            memory[name] = model.state_nbytes()
            cfg = model.cfg
            modes[name] = (cfg.landmark_mode or LANDMARK_MODES[cfg.variant][0]) if cfg.nystrom else None
        return StepResult(item.index, item.audio_time, source.name, self.frontend.description,
                          probabilities, top, flops, latency, memory,
                          {n: not s.trained for n, s in self.slots.items()}, modes,
                          dropped_hops=source.stats.dropped, ready_time=item.ready_time,
                          done_time=time.monotonic(), events=events, frontend_flops=item.flops,
                          spacing={n: s.spacing for n, s in self.slots.items()}, mel=item.mel)
