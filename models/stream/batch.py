"""Many streams of one model stepped as one batch: a slot per stream, each with its own position,
warm-up and events, so that streams join and leave at any step without touching the others.

Continual variants: the slots hold the state of the model's step (models/stream/model.py, the
step the ONNX export writes and the model's ``step()`` runs) with a slot as its stream axis, and
one call of that step takes every stream given. Its data-dependent events (a stale row
recomputed) are masks here (``events="masked"``: no host synchronisation), and a stream's event
changes no other stream's values. The events known from a stream's position alone (a
continual-landmark step's warm-up for t < n, its landmark replaced when (t + 1) mod n ends a
segment, else steady: nystrom.landmark_event) group the streams of a step instead, and each
group's call computes only its own branch (the step's ``known``): a steady step skips the rebuild
and the pseudo-inverse.

On the CPU the rare events branch on the host (a read costs nothing there), and a model that
the compiled backend takes (models/fused/backend.py: continual and continual Nyström, 1 and 2 blocks)
has its steady streams stepped by it, all in one call on the same slots (``fused``, the default
there): tens of microseconds a stream, where the torch step's few hundred small operations
cost milliseconds a call.

Recomputing variants (regular, nystrom): a slot holds the stream's last n tokens (a ring); a
step recomputes each stream's window with the model's batch forward, one call per window length
(streams in warm-up have fewer than n tokens; past it, one call for all).

A stream starts when it joins: its position is set to 0, and the step replaces every state
tensor by zeros at position 0, so a slot left by another stream needs no clearing.

No step waits for the device: the slots' positions are mirrored on the host (a step adds one),
so the recomputing variants group their streams by window length without asking the device,
and a step's events stay on the device until ``steps_flops`` or ``landmark_updates`` first reads
them (one copy for the whole step). On CUDA, a step whose streams are past warm-up (every step of
a continual variant) is a CUDA graph replayed from one captured per bucket of batch sizes
(1, 2, 4, ... up to the capacity): the step's slots and tokens are copied into the graph's
static inputs, the rows up to the bucket's size padded with a spare slot that no stream holds.

Shapes: S streams stepped, C slots; tokens (S, in_dim), logits (S, classes).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .. import flops as F
from ..sda import inference
from .model import CONTINUAL, ModelStep
from .segments import landmark_event

KNOWN = {0: None, 1: "steady", 2: "replace"}     # landmark_event's codes -> the step's ``known``


def steps_to_steady(cfg) -> int:
    """Steps after which a stream steps as it will from then on: its window full (recomputing
    variants: one call, one captured graph) and one landmark segment completed after it
    (continual landmarks: a replacing step taken)."""
    return cfg.window + -(-cfg.window // (cfg.num_landmarks or 1)) + 1


class SlotsFull(RuntimeError):
    """Every slot holds a stream."""


class Slots:
    """``capacity`` stream slots: ``take()`` the first free one, ``leave(slot)`` frees it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.taken = [False] * capacity

    def take(self) -> int:
        try:
            slot = self.taken.index(False)
        except ValueError:
            raise SlotsFull(f"all {self.capacity} slots hold a stream") from None
        self.taken[slot] = True
        return slot

    def leave(self, slot: int) -> None:
        self.taken[slot] = False

    @property
    def streams(self) -> int:
        return sum(self.taken)


class StreamBatch(Slots):
    """C slots of one model (a GenreTransformer in eval mode; its weights are shared, not copied).
    ``graphs``: replay captured CUDA graphs (default: on CUDA). ``fused``: steady steps in the
    compiled backend where it takes the model (default: as the model's own setting says).
    ``events``: how the step branches (default: "eager" on the CPU, "masked" elsewhere; "masked"
    on the CPU runs the CUDA path's step there). ``kernels``: a app/runtime/kernels.py Kernels,
    asked for the compiled kernels here; until ``kernels.ready()`` every stream takes the torch
    step (and a recomputing Nyström model its torch pseudo-inverse), from the first step after,
    the backend (None: at once, numba compiling on its first call)."""

    def __init__(self, model, capacity: int, *, graphs: bool | None = None, fused: bool | None = None,
                 events: str | None = None, kernels=None):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        super().__init__(capacity)
        self.model, self.cfg = model, model.cfg
        self.device = device = next(model.parameters()).device
        rows = capacity + 1                                  # slot C: the spare that pads a bucket
        self.t = torch.zeros(rows, dtype=torch.int64, device=device)            # (C + 1,) next position
        self._t_host = self.t.numpy() if device.type == "cpu" else None         # (the backend's view of it)
        self.positions = np.zeros(rows, np.int64)                                # its host mirror
        self.continual = self.cfg.variant in CONTINUAL
        self._fused = getattr(model, "fused", False) if fused is None else bool(fused)
        if self._fused and kernels is not None:
            kernels.request()                                  # loaded now where cached, else built beside
        self.kernels = kernels if self._fused and kernels is not None and not kernels.ready() else None
        self._compiled_pinv(self.kernels is None)
        self.backend = None
        self._last = np.zeros(0, np.int64)                      # (S,) the slots of the last step
        self.mode = model.landmark_mode
        self.events_mode = events or ("eager" if device.type == "cpu" else "masked")
        if self.continual:
            self._make_stepper()
            self.state = self.stepper.initial(rows, device)
            self._attach_backend()
        else:
            self.ring = torch.zeros(rows, self.cfg.window, self.cfg.in_dim, device=device,
                                    dtype=model.embed.weight.dtype)                           # (C + 1, n, D)
        self.events = torch.zeros(0, 4, dtype=torch.int64)     # (S, 4) of the last step (continual)
        self._events_host: np.ndarray | None = None
        self.stepped = np.zeros(0, np.int64)                   # (S,) positions + 1 after the last step
        self._flops: dict[tuple, dict[str, int]] = {}          # (position up to n + 1, events) -> FLOPs
        per_slot = ([math.prod(s.shape) * s.dtype.itemsize for s in self.stepper.spec()]
                    if self.continual else [self.ring[0].nbytes])
        self.slot_nbytes = sum(per_slot)
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self._captured: dict[tuple, _Captured] = {}

    def _make_stepper(self) -> None:
        """The step for the current landmark mode."""
        self.stepper = ModelStep(self.model, self.mode, events=self.events_mode).eval().to(self.device)

    def _attach_backend(self) -> None:
        """The compiled backend where it applies, bound to the slots' state (whose tensors the
        torch step updates in place from then on)."""
        self.backend = None
        if self._fused and self.kernels is None:
            from ..fused import available
            from ..fused.backend import backend
            if available():
                self.backend = backend(self.stepper, self.state)

    @property
    def fused(self) -> bool:
        return self.backend is not None

    def _compiled_pinv(self, on: bool) -> None:
        """A recomputing Nyström model's compiled pseudo-inverse, where the model asks for it."""
        if not self.continual:
            for block in self.model.blocks:
                block.attn.compiled_pinv = on and getattr(self.model, "fused", False)

    def _kernels_arrived(self) -> None:
        """(at a step's start) The compiled kernels are ready: the backend from this step on."""
        self.kernels = None
        self._compiled_pinv(True)
        if self.continual:
            self._attach_backend()

    # ------------------------------------------------------------------ slots
    def join(self) -> int:
        """A free slot for a new stream (its position 0)."""
        slot = self.take()
        self.t[slot] = 0
        self.positions[slot] = 0
        return slot

    def set_landmark_mode(self, mode: str) -> None:
        """Every stream of the batch to landmark ``mode`` (the model's blocks already set to it,
        GenreTransformer.set_landmark_mode), live: each stream's state rebuilt for the new
        landmarks from the window it holds (ModelStep.switched_from)."""
        if not self.continual or mode == self.mode:
            self.mode = mode
            return
        self.mode = mode
        self._make_stepper()
        slots = np.flatnonzero(self.taken)
        if len(slots):
            index = torch.from_numpy(slots).to(self.device)
            state = [s.index_select(0, index) for s in self.state]
            with torch.no_grad():
                new = self.stepper.switched_from(state, self.t.index_select(0, index))
            for whole, part in zip(self.state, new):
                whole.index_copy_(0, index, part)
        self._attach_backend()
        self._captured.clear()
        self._flops.clear()

    # ------------------------------------------------------------------ what the last step did
    def events_host(self) -> np.ndarray:
        """(S, 4) events of the last step, copied from the device once."""
        if self._events_host is None:
            self._events_host = self.events.cpu().numpy()
        return self._events_host

    def steps_flops(self) -> list[dict[str, int]]:
        """FLOPs of the last step of every stream stepped (models/flops.py: the formulas of the
        step for its position and events; the masked branches not taken are not counted). They
        depend on the position only up to n + 1, so each count is made once per kind of step
        (the same dict, read-only, for the streams that stepped alike)."""
        n = self.cfg.window
        t = np.minimum(self.stepped, n + 1)[:, None]
        keys = np.concatenate([t, self.events_host()], axis=1) if self.continual else t     # (S, 1 or 5)
        kinds, which = np.unique(keys, axis=0, return_inverse=True)
        counts = [self._count(tuple(row)) for row in kinds.tolist()]
        return [counts[j] for j in which.reshape(-1).tolist()]

    def step_flops(self, i: int) -> dict[str, int]:
        """``steps_flops`` of the i-th stream stepped, a copy."""
        return dict(self.steps_flops()[i])

    def _count(self, key: tuple) -> dict[str, int]:
        """FLOPs of a step at position min(t, n + 1) = key[0] with events key[1:] (continual)."""
        if key not in self._flops:
            t = key[0]
            detail = (F.graph_step(self.cfg, self.mode, t, key[1:]) if self.continual
                      else F.recompute_step(self.cfg, min(t, self.cfg.window), self.mode))
            self._flops[key] = {k: v.total for k, v in detail.items()}
        return self._flops[key]

    def landmark_updates(self) -> list[bool]:
        """Whether each stream of the last step installed new landmarks."""
        if not self.continual:
            return [False] * len(self._last)
        return (self.events_host()[:, 1] != 0).tolist()

    def windows_full(self) -> list[bool]:
        """Whether each stream of the last step had n tokens in its window (warm-up over)."""
        return (self.stepped >= self.cfg.window).tolist()

    # ------------------------------------------------------------------ step
    def step(self, slots, tokens: Tensor) -> Tensor:
        """One token for each stream in ``slots`` (S ints, or an (S,) host tensor) -> its logits
        (S, classes) on the model's device. Where the compiled backend takes every stream's
        step, one call of it and nothing else."""
        slots = np.ascontiguousarray(slots.tolist() if isinstance(slots, Tensor) else slots, np.int64)
        if self.kernels is not None and self.kernels.ready():
            self._kernels_arrived()
        t = self.positions[slots]
        after = t + 1
        self.positions[slots] = after
        self.stepped, self._events_host, self._last = after, None, slots
        backend = self.backend
        if backend is not None and backend.all_steady(t):
            self._t_host[slots] = after                         # the backend is on the CPU
            x = (tokens.cpu() if tokens.is_cuda else tokens).float().contiguous()    # (as ``_step``'s ``.to``)
            logits, self.events = backend.step((x.detach() if x.requires_grad else x).numpy(), slots, t)
            return logits
        return self._step(slots, tokens, t)

    @inference
    def _step(self, slots: np.ndarray, tokens: Tensor, t: np.ndarray) -> Tensor:
        tokens = tokens.to(self.device, non_blocking=True)
        if not self.continual:
            if self.graphs and t.min(initial=self.cfg.window) >= self.cfg.window:
                return self._replay(slots, tokens, None)[0]
            return self._recompute(self._dev(slots), tokens, t)
        codes = (landmark_event(t, self.cfg.window, self.cfg.num_landmarks) if self.mode == "continual"
                 else np.ones(len(slots), np.int64))
        if self.backend is not None:                           # the compiled backend's streams: code 3
            tokens = tokens.float().contiguous()
            codes = np.where(self.backend.steady(t), 3, codes)
        kinds = [int(codes[0])] if (codes == codes[0]).all() else np.unique(codes).tolist()
        if len(kinds) == 1:
            logits, self.events = self._steps(slots, tokens, t, kinds[0])
            return logits
        logits = tokens.new_empty(len(slots), self.cfg.num_classes)
        self.events = torch.empty(len(slots), 4, dtype=torch.int64, device=self.device)
        for kind in kinds:                                     # streams grouped by what they do
            rows = np.flatnonzero(codes == kind)
            index = self._dev(rows)
            logits[index], self.events[index] = self._steps(slots[rows], tokens.index_select(0, index), t[rows], kind)
        return logits

    def _steps(self, slots: np.ndarray, tokens: Tensor, t: np.ndarray, code: int) -> tuple[Tensor, Tensor]:
        """Streams that step alike: the compiled backend (code 3), or the step with what it
        does known from the positions (the step's ``known``)."""
        if code == 3:
            self._t_host[slots] += 1                            # the backend is on the CPU
            return self.backend.step(tokens.numpy(), slots, t)
        if self.graphs:
            return self._replay(slots, tokens, KNOWN[code])
        first = int(slots[0])
        if (np.diff(slots) == 1).all():                        # a range of slots (one stream, say)
            return self._continual(None, tokens, KNOWN[code], slice(first, first + len(slots)))
        return self._continual(self._dev(slots), tokens, KNOWN[code])

    def _dev(self, a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def _continual(self, slots: Tensor, tokens: Tensor, known: str | None = None,
                   run: slice | None = None) -> tuple[Tensor, Tensor]:
        """``run``: the slots as a range, known on the host (then the state is read as views and
        only the tensors the step changed are written back), else gathered by ``slots``."""
        if run is not None:
            state = [s[run] for s in self.state]
            t = self.t[run]
            logits, events, *new = self.stepper(tokens, t, *state, known=known)
            for whole, old, part in zip(self.state, state, new):
                if part is not old:
                    whole[run] = part
            self.t[run] += 1
            return logits, events
        state = [s.index_select(0, slots) for s in self.state]
        t = self.t.index_select(0, slots)
        logits, events, *state = self.stepper(tokens, t, *state, known=known)
        for whole, part in zip(self.state, state):
            whole.index_copy_(0, slots, part)
        self.t.index_copy_(0, slots, t + 1)
        return logits, events

    def _recompute(self, slots: Tensor, tokens: Tensor, t: np.ndarray) -> Tensor:
        """t: the streams' positions (host), which group them by window length."""
        n = self.cfg.window
        n_t = np.minimum(t + 1, n)
        if n_t.min() == n:                                  # past warm-up: one call, no grouping
            return self._window(slots, tokens, n)
        logits = tokens.new_empty(len(slots), self.cfg.num_classes)
        for length in np.unique(n_t).tolist():
            rows = torch.from_numpy(np.flatnonzero(n_t == length)).to(self.device, non_blocking=True)
            logits[rows] = self._window(slots.index_select(0, rows), tokens.index_select(0, rows), length)
        return logits

    def _window(self, slots: Tensor, tokens: Tensor, length: int) -> Tensor:
        """Streams whose windows hold ``length`` tokens after this one: ring write, then the
        model's batch forward on each window in stream order."""
        n, period = self.cfg.window, self.cfg.period
        t = self.t.index_select(0, slots)                                        # (S,)
        self.ring[slots, t % n] = tokens
        self.t.index_copy_(0, slots, t + 1)
        first = t + 1 - length                                                   # (S,) oldest position
        order = (first.unsqueeze(1) + torch.arange(length, device=t.device)) % n  # (S, length)
        window = self.ring[slots.unsqueeze(1), order]                            # (S, length, D)
        return self.model(window, start=first % period)

    # ------------------------------------------------------------------ CUDA graphs
    def _replay(self, slots: np.ndarray, tokens: Tensor, known: str | None) -> tuple[Tensor, Tensor]:
        size = min(1 << (len(slots) - 1).bit_length(), 1 << (self.capacity - 1).bit_length())
        captured = self._captured.get((size, known)) or self._capture(size, known)
        return captured.replay(slots, tokens, self.capacity)

    def _capture(self, size: int, known: str | None) -> "_Captured":
        body = ((lambda s, x: self._continual(s, x, known)) if self.continual
                else (lambda s, x: (self._window(s, x, self.cfg.window), x.new_zeros(len(s), 4, dtype=torch.int64))))
        self._captured[size, known] = captured = _Captured(body, size, self.cfg.in_dim, self.device, spare=self.capacity)
        return captured


class _Captured:
    """One bucket's CUDA graph of ``body(slots, tokens) -> (logits, events)``, captured with every
    row on the spare slot (so the warm-up runs and the capture change no stream), replayed with
    the step's slots and tokens in its static inputs."""

    def __init__(self, body, size: int, in_dim: int, device, spare: int):
        self.size = size
        self.host = torch.full((size,), spare, dtype=torch.int64).pin_memory()
        self.copied = torch.cuda.Event()
        self.slots = torch.full((size,), spare, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(size, in_dim, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):                       # library handles and workspaces first
            for _ in range(2):
                body(self.slots, self.tokens)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits, self.events = body(self.slots, self.tokens)

    def replay(self, slots: np.ndarray, tokens: Tensor, spare: int) -> tuple[Tensor, Tensor]:
        S = len(slots)
        self.copied.synchronize()                           # the last replay's slots have left the host buffer
        host = self.host.numpy()
        host[:S], host[S:] = slots, spare
        self.slots.copy_(self.host, non_blocking=True)
        self.copied.record()
        self.tokens[:S].copy_(tokens)
        self.graph.replay()
        return self.logits[:S].clone(), self.events[:S].clone()
