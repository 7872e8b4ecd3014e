"""Many streams of one model stepped as one batch: a slot per stream, each with its own position,
warm-up and events, so that streams join and leave at any step without touching the others.

Continual variants: the slots hold the explicit state of the model's step graph
(models/stream/, the graph the ONNX export writes) stacked along a slot axis, and one
call of ``torch.func.vmap`` over the graph steps every stream given. The graph's data-dependent
events (a stale row recomputed) are masks here (``masked=True``: both branches, a per-stream
select), never Python branches: a step has no host synchronisation, and a stream's event changes
no other stream's values. The events known from a stream's position alone (a continual-landmark
step's warm-up for t < n, its landmark replaced when (t + 1) mod n ends a segment, else steady:
graph_landmarks.landmark_event) group the streams of a step instead, and each group's graph
computes only its own branch (``ContinualNystromGraph.known``): a steady step skips the rebuild
and the pseudo-inverse.

On the CPU, a continual model with a compiled step (models/fused/: 1 block, or 2 blocks)
steps each stream by that step instead, on a clone of the model per slot that shares its
weights (``fused``, the default there): tens of microseconds a stream, where the vmapped
graph's few hundred small operations cost milliseconds a call; each stream's logits are then
its single-stream step's, bit for bit.

Recomputing variants (regular, nystrom): a slot holds the stream's last n tokens (a ring); a
step recomputes each stream's window with the model's batch forward, one call per window length
(streams in warm-up have fewer than n tokens; past it, one call for all).

A stream starts when it joins: its position is set to 0, and the graph replaces every state
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

import copy
import math

import numpy as np
import torch
from torch import Tensor

from .. import flops as F
from .graph import EXPORTABLE
from .graph_landmarks import ContinualNystromGraph, landmark_event
from .two_block import stream_graph

KNOWN = {0: None, 1: "steady", 2: "replace"}     # landmark_event's codes -> ContinualNystromGraph.known


def has_fused_step(model) -> bool:
    """Whether ``model`` steps by a compiled step (models/fused/; the model's own setting)."""
    if not getattr(model, "fused", False):           # off, or no compiler here: nothing to import
        return False
    from ..fused.model_step import fusable
    from ..fused.two_block import fusable_two_block
    return fusable(model) or fusable_two_block(model)


def shared_weights_clone(model):
    """A copy of ``model`` with its own step state and the model's weights: its parameters and
    buffers, and every submodule without step state (none in it or below it has ``reset``), are
    the model's own objects, not copies; only the modules on the way to a state are copied."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    memo.update({id(m): m for m in model.modules() if not any(hasattr(s, "reset") for s in m.modules())})
    memo[id(getattr(model, "_fused_step", None))] = None    # rebuilt by the clone's reset
    return copy.deepcopy(model, memo)


def steps_to_steady(cfg) -> int:
    """Steps after which a stream steps as it will from then on: its window full (recomputing
    variants: one call, one captured graph) and one landmark segment completed after it
    (continual landmarks: a replacing step taken)."""
    return cfg.window + -(-cfg.window // (cfg.num_landmarks or 1)) + 1


class SlotsFull(RuntimeError):
    """Every slot holds a stream."""


class StreamBatch:
    """C slots of one model (a GenreTransformer in eval mode; its weights are shared, not copied).
    ``graphs``: replay captured CUDA graphs (default: on CUDA). ``fused``: step each stream by
    the model's compiled step where it has one (default: where the model uses it, on the CPU)."""

    def __init__(self, model, capacity: int, *, graphs: bool | None = None, fused: bool | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.model, self.cfg, self.capacity = model, model.cfg, capacity
        self.device = device = next(model.parameters()).device
        rows = capacity + 1                                  # slot C: the spare that pads a bucket
        self.t = torch.zeros(rows, dtype=torch.int64, device=device)            # (C + 1,) next position
        self.positions = np.zeros(rows, np.int64)                                # its host mirror
        self.taken = [False] * capacity
        self.continual = self.cfg.variant in EXPORTABLE
        self.fused = self.continual and has_fused_step(model) if fused is None else bool(fused)
        if self.fused and not has_fused_step(model):
            raise ValueError(f"a {self.cfg.variant} model of {self.cfg.layers} block(s) on {device} has no fused step")
        self.clones: list = [None] * capacity                   # per slot (fused): the model sharing its weights
        self._last = np.zeros(0, np.int64)                      # (S,) the slots of the last step
        if self.continual:
            self.graph = stream_graph(model, masked=True).eval().to(device)
            self.state = [torch.zeros((0 if self.fused else rows, *s.shape), dtype=s.dtype, device=device)
                          for s in self.graph.state_spec()]
            self.batched = torch.func.vmap(self.graph.forward)
            self.landmark_graphs = [g for g in self.graph.modules() if isinstance(g, ContinualNystromGraph)]
        else:
            self.ring = torch.zeros(rows, self.cfg.window, self.cfg.in_dim, device=device)   # (C + 1, n, D)
        self.events = torch.zeros(0, 3, dtype=torch.int64)     # (S, 3) of the last step (continual)
        self._events_host: np.ndarray | None = None
        self.stepped = np.zeros(0, np.int64)                   # (S,) positions + 1 after the last step
        self.mode = model.landmark_mode
        self._flops: dict[tuple, dict[str, int]] = {}          # (position up to n + 1, events) -> FLOPs
                                                               # (fused: the clone's step_flops_key)
        per_slot = ([math.prod(s.shape) * s.dtype.itemsize for s in self.graph.state_spec()]
                    if self.continual else [self.cfg.window * self.cfg.in_dim * 4])
        self.slot_nbytes = sum(per_slot)
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self._captured: dict[tuple, _Captured] = {}

    # ------------------------------------------------------------------ slots
    def join(self) -> int:
        """A free slot for a new stream (its position 0)."""
        try:
            slot = self.taken.index(False)
        except ValueError:
            raise SlotsFull(f"all {self.capacity} slots hold a stream") from None
        self.taken[slot] = True
        self.t[slot] = 0
        self.positions[slot] = 0
        if self.fused:
            if self.clones[slot] is None:
                self.clones[slot] = shared_weights_clone(self.model)
            self.clones[slot].reset(1)
        return slot

    def leave(self, slot: int) -> None:
        self.taken[slot] = False

    @property
    def streams(self) -> int:
        return sum(self.taken)

    # ------------------------------------------------------------------ what the last step did
    def events_host(self) -> np.ndarray:
        """(S, 3) events of the last step, copied from the device once."""
        if self._events_host is None:
            self._events_host = self.events.cpu().numpy()
        return self._events_host

    def steps_flops(self) -> list[dict[str, int]]:
        """FLOPs of the last step of every stream stepped (models/flops.py: the formulas of the
        single-stream step for its position and events; the masked branches not taken are not
        counted). They depend on the position only up to n + 1, so each count is made once per
        kind of step (the same dict, read-only, for the streams that stepped alike)."""
        if self.fused:
            keys = [(self.clones[slot], self.clones[slot].step_flops_key()) for slot in self._last.tolist()]
            for clone, key in keys:
                if key not in self._flops:
                    self._flops[key] = clone.step_flops()
            return [self._flops[key] for _, key in keys]
        n = self.cfg.window
        t = np.minimum(self.stepped, n + 1)[:, None]
        keys = np.concatenate([t, self.events_host()], axis=1) if self.continual else t     # (S, 1 or 4)
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
        if self.fused:
            return [self.clones[slot].landmark_updated() for slot in self._last.tolist()]
        if not self.continual:
            return [False] * len(self._last)
        return (self.events_host()[:, 1] != 0).tolist()

    def windows_full(self) -> list[bool]:
        """Whether each stream of the last step had n tokens in its window (warm-up over)."""
        return (self.stepped >= self.cfg.window).tolist()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, slots, tokens: Tensor) -> Tensor:
        """One token for each stream in ``slots`` (S ints, or an (S,) host tensor) -> its logits
        (S, classes) on the model's device."""
        slots = np.asarray(slots.tolist() if isinstance(slots, Tensor) else slots, np.int64)
        t = self.positions[slots]
        self.positions[slots] = t + 1
        self.stepped, self._events_host, self._last = t + 1, None, slots
        if self.fused:
            return self._fused_steps(slots, tokens)
        tokens = tokens.to(self.device, non_blocking=True)
        if not self.continual:
            if self.graphs and t.min(initial=self.cfg.window) >= self.cfg.window:
                return self._replay(slots, tokens, None)[0]
            return self._recompute(self._dev(slots), tokens, t)
        codes = (landmark_event(t, self.cfg.window, self.cfg.num_landmarks) if self.landmark_graphs
                 else np.zeros(len(slots), np.int64))
        kinds = np.unique(codes).tolist()
        if len(kinds) == 1:
            logits, self.events = self._known_step(slots, tokens, KNOWN[kinds[0]])
            return logits
        logits = tokens.new_empty(len(slots), self.cfg.num_classes)
        self.events = torch.empty(len(slots), 3, dtype=torch.int64, device=self.device)
        for kind in kinds:                                   # streams grouped by what they do
            rows = np.flatnonzero(codes == kind)
            index = self._dev(rows)
            logits[index], self.events[index] = self._known_step(slots[rows], tokens.index_select(0, index), KNOWN[kind])
        return logits

    def _dev(self, a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def _fused_steps(self, slots: np.ndarray, tokens: Tensor) -> Tensor:
        """Each stream's step by its slot's clone: the single-stream step itself."""
        tokens = tokens.detach().to("cpu", torch.float32).contiguous()              # (S, in_dim)
        logits = torch.empty(len(slots), self.cfg.num_classes)
        for i, slot in enumerate(slots.tolist()):
            logits[i] = self.clones[slot].step(tokens[i:i + 1])[0]
        return logits

    def _known_step(self, slots: np.ndarray, tokens: Tensor, known: str | None) -> tuple[Tensor, Tensor]:
        """Streams whose step is ``known`` from their positions (graph_landmarks.ContinualNystromGraph.known)."""
        if self.graphs:
            return self._replay(slots, tokens, known)
        return self._continual(self._dev(slots), tokens, known)

    def _continual(self, slots: Tensor, tokens: Tensor, known: str | None = None) -> tuple[Tensor, Tensor]:
        for graph in self.landmark_graphs:
            graph.known = known
        state = [s.index_select(0, slots) for s in self.state]
        logits, t_next, events, *state = self.batched(tokens.unsqueeze(1), self.t.index_select(0, slots), *state)
        for whole, part in zip(self.state, state):
            whole.index_copy_(0, slots, part)
        self.t.index_copy_(0, slots, t_next)
        return logits.squeeze(1), events

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
                else (lambda s, x: (self._window(s, x, self.cfg.window), x.new_zeros(len(s), 3, dtype=torch.int64))))
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
