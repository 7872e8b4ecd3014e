"""Front ends: 16 kHz audio -> one token per 0.25 s hop, pluggable.

  musicnn (default; its pretrained weights ship with the ``musicnn`` package): taggram (50,) of
      the latest 3 s, computed continually (audio/musicnn/batch.py). Its token files (the
      original implementation's grid) are 61 mel frames = 0.976 s apart, so models trained on
      them are fed every 4th hop (``native_spacing``).
  vggish (the paper's): embedding (128,) of the latest 0.96 s, AudioSet weights from
      file/cache/download or seeded random weights; one token per hop.

``FrontEnd.stream()`` gives a fresh per-stream state whose ``push(hop)`` returns a ``HopToken``;
``FrontEnd.file_tokens(path)`` gives a file's tokens on the grid its token files use.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from . import melspec
from .errors import PrecisionError
from .musicnn import PRECISION_WORDS
from .musicnn import mel as musicnn_mel
from .musicnn.batch import MusicnnBatch
from .musicnn.graph import STEADY_FRAMES, CompiledPushes, GraphStream, compiling_enabled
from .vggish import vggish_flops

from .frontend_names import FRONTENDS
DEFAULT_FRONTEND = "musicnn"


@dataclass
class HopToken:
    token: torch.Tensor       # (1, D)
    mel: np.ndarray           # (k, bands) log-mel frames this hop added (for display)
    mel_ms: float             # time spent on the log-mel
    network_ms: float         # time spent on the network
    flops: int                # FLOPs of the network for this hop (2 x multiply-accumulates)


@dataclass
class HopTokens:
    """One hop of many streams (a slots' ``push``): stream i's token is row i of ``tokens``,
    kept together (no per-stream tensor); its other fields are per stream."""
    tokens: torch.Tensor      # (S, D) on the network's device
    mels: list[np.ndarray]    # (k, bands) log-mel frames each stream's hop added (for display)
    mel_ms: list[float]       # each stream's share of the log-mel's time
    network_ms: list[float]   # each stream's share of the network's time
    flops: list[int]          # each stream's network FLOPs


class FrontEnd(Protocol):
    """What every front end offers (VGGishFrontEnd, MusicnnFrontEnd)."""
    name: str                 # 'musicnn' | 'vggish'
    token_dim: int            # D of the (1, D) tokens
    bands: int                # mel bands of the log-mel it shows (HopToken.mel)
    description: str          # which network and weights, for every output
    checksum: str             # sha256 of the weights, or 'random-<seed>'
    random: bool              # random weights (tokens mean nothing)
    native_spacing: int       # hops between the tokens of this front end's token files
    mel_levels: tuple         # (low, high) colour range of its log-mel values, for display
    frame_ms: float           # milliseconds between its log-mel frames
    device: torch.device

    def stream(self):
        """A fresh per-stream state with ``push(hop (4000,)) -> HopToken``."""
        ...

    def batch(self, capacity: int):
        """Slots for ``capacity`` streams: ``join() -> slot``, ``leave(slot)``, and
        ``push(slots, hops) -> HopTokens`` running the network once for every stream given."""
        ...

    def file_tokens(self, path: str | Path) -> tuple[torch.Tensor, dict]:
        """A file's tokens (T, D) on the grid its token files use, and decode info."""
        ...

    def push_status(self) -> str | None:
        """How its one stream's network runs, where that can change (the compiled musicnn push), or None."""
        ...


class _Slots:
    """Per-slot log-mel state beside a batched network; a subclass says how one hop's mel
    states become the network's tokens."""

    def __init__(self, capacity: int, device):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.mels: list = [None] * capacity
        self.device = torch.device(device)        # the network's

    def join(self) -> int:
        if None not in self.mels:
            raise ValueError(f"all {len(self.mels)} front-end slots are taken")
        slot = self.mels.index(None)
        self.mels[slot] = self.new_mel()
        self.joined(slot)
        return slot

    def leave(self, slot: int) -> None:
        self.mels[slot] = None

    def joined(self, slot: int) -> None:
        pass

    def push(self, slots: list[int], hops: list[np.ndarray]) -> HopTokens:
        """One hop of each stream in ``slots``: its log-mel alone, the network for all at once;
        each token's ``network_ms`` is its share of the batched call. The tokens stay on the
        network's device (on CUDA the call returns before the device is done; ``network_start``
        is then a CUDA event recorded as the network began, for the caller's timing)."""
        mels, mel_ms = [], []
        for slot, hop in zip(slots, hops):
            t0 = time.perf_counter()
            mels.append(self.mels[slot].push(hop))
            mel_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        if self.device.type == "cuda":             # the network's start on the device's timeline
            self.network_start = torch.cuda.Event(enable_timing=True)
            self.network_start.record()
        tokens, flops = self.network(slots, mels)
        share = (time.perf_counter() - t0) * 1e3 / max(len(slots), 1)
        return HopTokens(tokens, [self.shown(m) for m in mels], mel_ms, [share] * len(slots), list(flops))


class _OneSlot:
    """One stream's front-end state with the slots' interface (``join``, ``leave``, ``push``)."""

    def __init__(self, frontend):
        self.frontend, self.device, self.state = frontend, frontend.device, None

    def join(self) -> int:
        if self.state is not None:
            raise ValueError("all 1 front-end slots are taken")
        self.state = self.frontend.stream()
        return 0

    def leave(self, slot: int) -> None:
        self.state = None

    def push(self, slots: list[int], hops: list[np.ndarray]) -> HopTokens:
        one = self.state.push(hops[0])
        return HopTokens(one.token, [one.mel], [one.mel_ms], [one.network_ms], [one.flops])


class _SlotStream:
    """One stream as the one slot of a front end's slots (VGGish; musicnn on CUDA or recomputed)."""

    def __init__(self, slots: _Slots):
        self.slots = slots
        self.slot = slots.join()

    def push(self, hop: np.ndarray) -> HopToken:
        out = self.slots.push([self.slot], [hop])
        return HopToken(out.tokens[:1].cpu(), out.mels[0], out.mel_ms[0], out.network_ms[0], out.flops[0])


def frontend_metadata(fe: FrontEnd) -> dict:
    """What a token file and a checkpoint record about the tokens' origin."""
    return {"name": fe.name, "token_dim": fe.token_dim, "weights": fe.checksum,
            "random": fe.random, "spacing_hops": fe.native_spacing}


# ----------------------------------------------------------------------------- VGGish

class VGGishFrontEnd:
    name, token_dim, bands, native_spacing = "vggish", 128, melspec.BANDS, 1
    mel_levels, frame_ms = (-7.0, 3.0), 1e3 * melspec.STEP / melspec.SAMPLE_RATE      # log(mel + 0.01)

    def __init__(self, embedder):
        self.embedder = embedder
        self.device = embedder.device
        self.description, self.checksum, self.random = embedder.description, embedder.checksum, embedder.random

    def stream(self):
        return _SlotStream(self.batch(1))

    def batch(self, capacity: int):
        return _VGGishSlots(self.embedder, capacity)

    def file_tokens(self, path):
        from .tokens import tokens_for_file
        return tokens_for_file(path, self.embedder)

    def push_status(self) -> None:
        return None


class _VGGishSlots(_Slots):
    def __init__(self, embedder, capacity: int):
        super().__init__(capacity, embedder.device)
        self.embedder, self.flops = embedder, vggish_flops()

    def new_mel(self):
        return melspec.StreamingLogMel()

    def network(self, slots, patches):
        return self.embedder(np.stack(patches)), [self.flops] * len(slots)

    def shown(self, patch):
        return patch[-melspec.FRAMES_PER_HOP:]


# ----------------------------------------------------------------------------- musicnn

class MusicnnFrontEnd:
    name, token_dim, bands = "musicnn", 50, musicnn_mel.BANDS
    mel_levels, frame_ms = (0.0, 4.0), 1e3 * musicnn_mel.FRAME_HOP / musicnn_mel.SAMPLE_RATE  # log10(1e4 x + 1)
    native_spacing = round(musicnn_mel.PATCH_HOP * musicnn_mel.FRAME_HOP / melspec.HOP)   # 4

    def __init__(self, model: str = "MSD_musicnn", *, device="cpu", continual: bool = True, precision: str = "float32"):
        from .musicnn import build_musicnn, precision_problem
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("cpu")
        problem = precision_problem(precision, device, continual)
        if problem:
            raise PrecisionError(problem)
        self.net, self.checksum = build_musicnn(model, device=device)
        self.net.precision = precision                                   # audio/musicnn: ``precision``
        self.model, self.device, self.continual, self.random = model, device, continual, False
        self.description = (f"musicnn {model} (pretrained, {'continual' if continual else 'recomputed'}"
                            f"{'' if precision == 'float32' else ', ' + PRECISION_WORDS[precision]})")
        self.pushes = None                    # one stream's compiled pushes: ``stream``
        musicnn_mel.mel_basis()               # computed now, not on the first hop
        self.graph = continual and device.type == "cpu"   # one stream's push as one graph (GraphStream)
        self.warm = _GraphStream(self.net) if self.graph else self._slot_stream()
        for _ in range(3):                                 # first-call costs (kernels, tap tables) now too;
            self.warm.push(np.zeros(melspec.HOP, np.float32))   # later streams share its tables (GraphStream ``like``)

    def stream(self):
        """One stream's state. On the CPU, continual, the push as one graph, and the first such
        stream loads (or builds) the compiled pushes all share (audio/musicnn/graph.py
        ``CompiledPushes``), which slots of many streams never do; else the one slot of a batch."""
        if not self.graph:
            return self._slot_stream()
        if self.pushes is None and compiling_enabled():
            self.pushes = CompiledPushes(self.model, self.checksum, STEADY_FRAMES, self.net.precision)
        return _GraphStream(self.net, self.pushes, like=self.warm.net)

    def _slot_stream(self):
        return _SlotStream(_MusicnnSlots(self.net, self.continual, 1))

    def batch(self, capacity: int):
        """Slots for ``capacity`` streams; one continual stream on the CPU keeps the push as one graph
        (GraphStream, audio/musicnn/graph.py), faster than a batch of one (docs/front-ends.md)."""
        if capacity == 1 and self.graph:
            return _OneSlot(self)
        return _MusicnnSlots(self.net, self.continual, capacity)

    @torch.no_grad()
    def file_tokens(self, path, batch_size: int = 16):
        """Tokens of a file on the original implementation's grid (resampy 0.2.2 kaiser_best
        resampling, patches every 61 frames): (P, 50) and decode info."""
        from .decoding import decode_native
        signal, rate, info = decode_native(path)
        y = musicnn_mel.resample_kaiser_best(signal, rate)
        patches = musicnn_mel.offline_patches(y)
        out = [self.net(torch.from_numpy(patches[i:i + batch_size]).to(self.device)).cpu()
               for i in range(0, len(patches), batch_size)]
        return torch.cat(out), info

    def push_status(self) -> str | None:
        """'compiled (AOTInductor)', eager while it builds, or eager and why; None where no stream
        has asked for the compiled push (many streams, CUDA, recomputed, or compiling off)."""
        return None if self.pushes is None else self.pushes.words()


class _GraphStream:
    """One CPU stream's continual push as one graph (GraphStream: compiled once ``pushes`` has it)."""

    def __init__(self, net, pushes=None, like=None):
        self.mel = musicnn_mel.StreamingMel()
        self.net = GraphStream(net, pushes, like)

    def push(self, hop: np.ndarray) -> HopToken:
        t0 = time.perf_counter()
        frames = self.mel.push(hop)
        t1 = time.perf_counter()
        token = self.net.push(frames)[None].cpu()
        t2 = time.perf_counter()
        return HopToken(token, frames, (t1 - t0) * 1e3, (t2 - t1) * 1e3, 2 * self.net.last_macs)


class _MusicnnSlots(_Slots):
    """Continual: the caches of every slot in one MusicnnBatch. Recomputed: each slot's raw
    187-frame patch, the network run on all of them."""

    def __init__(self, net, continual: bool, capacity: int):
        super().__init__(capacity, net.input_bn.mean.device)
        self.net, self.continual = net, continual
        # CUDA: every slot's unframed samples on the device, all streams framed in one gather (the
        # host does no per-stream work); CPU: each slot's StreamingMel (numpy: several times faster
        # than the gather there; docs/benchmarks.md, design measurements)
        self.framing = musicnn_mel.SlotFrames(capacity, self.device) if self.device.type == "cuda" else None
        if continual:
            self.caches = MusicnnBatch(net, capacity)
        else:
            from .musicnn import PATCH_FRAMES, patch_macs
            self.patches = torch.zeros(capacity, PATCH_FRAMES, musicnn_mel.BANDS, device=self.device)
            self.macs = patch_macs()

    def new_mel(self):
        return musicnn_mel.StreamingMel() if self.framing is None else True   # True: its samples in ``framing``

    def joined(self, slot: int) -> None:
        if self.framing is not None:
            self.framing.reset(slot)
        if self.continual:
            self.caches.reset(slot)
        else:
            self.patches[slot] = 0.0

    @torch.no_grad()
    def push(self, slots: list[int], hops: list[np.ndarray]) -> HopTokens:
        """Every stream's new sample frames (on CUDA in one gather on the device; on the CPU each
        stream's own), their log-mels in one call on the network's device (audio/musicnn/mel.py:
        the host's values), then the network for every stream.
        Each token's ``mel_ms`` and ``network_ms`` are its shares of the two calls; on CUDA
        ``mel_start`` and ``network_start`` are events recorded as each began."""
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        if cuda:
            self.mel_start = torch.cuda.Event(enable_timing=True)
            self.mel_start.record()
        if self.framing is not None:
            frames, counts = self.framing.frames(slots, hops)                      # (F, 512), (S,)
            counts = counts.tolist()
        else:
            per = [self.mels[slot].frames(hop) for slot, hop in zip(slots, hops)]
            counts = [len(f) for f in per]
            frames = torch.from_numpy(np.concatenate(per + [np.zeros((0, musicnn_mel.N_FFT), np.float32)]))
        mel = musicnn_mel.log_mel_of_frames_torch(frames)                           # (F, 96)
        shown = _on_host(mel)
        t1 = time.perf_counter()
        if cuda:
            self.network_start = torch.cuda.Event(enable_timing=True)
            self.network_start.record()
        tokens, flops = self.network(slots, mel, counts)
        t2, n = time.perf_counter(), max(len(slots), 1)
        ends = np.cumsum(counts).tolist()
        mels = [shown[end - k:end] for end, k in zip(ends, counts)]
        return HopTokens(tokens, mels, [(t1 - t0) * 1e3 / n] * len(slots), [(t2 - t1) * 1e3 / n] * len(slots), flops)

    def network(self, slots, mel: torch.Tensor, counts: list[int]):
        """mel: every stream's new log-mel frames, stream after stream (``counts`` each)."""
        if self.continual:
            taggrams = self.caches.push_rows(slots, mel, counts)
            return taggrams, [2 * int(self.caches.macs[s]) for s in slots]
        ends = np.cumsum(counts)
        for slot, end, count in zip(slots, ends.tolist(), counts):
            k = min(count, len(self.patches[slot]))
            if k:
                self.patches[slot] = torch.cat([self.patches[slot, k:], mel[end - k:end]])
        return self.net(self.patches[slots]), [2 * self.macs] * len(slots)


def _on_host(t: torch.Tensor) -> np.ndarray:
    """A device tensor's values on the host, copied without waiting: read them only after the
    device has caught up (the caller's one wait per hop)."""
    if t.device.type == "cpu":
        return t.numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host.numpy()


# ----------------------------------------------------------------------------- building

def build_frontend(name: str = DEFAULT_FRONTEND, *, device="cpu", vggish_weights=None,
                   random_vggish: int | None = None, musicnn_model: str = "MSD_musicnn",
                   continual: bool = True, allow_download: bool = True, precision: str = "float32") -> FrontEnd:
    """A ready front end; raises MusicnnWeightsError / VGGishWeightsError / PrecisionError with
    what to do. ``precision``: musicnn's arithmetic (audio/musicnn: ``PRECISIONS``); VGGish
    runs float32 and refuses any other."""
    if name == "musicnn":
        return MusicnnFrontEnd(musicnn_model, device=device, continual=continual, precision=precision)
    if precision != "float32":
        raise PrecisionError(f"precision {precision} is for the musicnn front end (VGGish runs float32)")
    if name == "vggish":
        from .vggish import build_embedder
        return VGGishFrontEnd(build_embedder(vggish_weights, random_seed=random_vggish,
                                             device=device, allow_download=allow_download))
    raise ValueError(f"unknown front end {name!r}; valid: {', '.join(FRONTENDS)}")


def resolve_name(frontend: str | None, vggish_weights=None, random_vggish=None) -> str:
    """The front end a command runs: as given, else vggish when VGGish weights (or random ones)
    were asked for, else the default (musicnn)."""
    if frontend:
        return frontend
    return "vggish" if vggish_weights or random_vggish is not None else DEFAULT_FRONTEND


def as_frontend(x) -> FrontEnd:
    """A FrontEnd from a FrontEnd or a VGGish Embedder."""
    from .vggish import Embedder
    return VGGishFrontEnd(x) if isinstance(x, Embedder) else x


def token_dim(name: str) -> int:
    """Token size of the front end called ``name``."""
    return {"musicnn": MusicnnFrontEnd.token_dim, "vggish": VGGishFrontEnd.token_dim}[name]


def frontend_of_tokens(metadata: dict, dim: int) -> dict:
    """The front-end record of a token file (older files: inferred from the token size)."""
    fe = metadata.get("frontend_info")
    if isinstance(fe, dict) and fe.get("name") in FRONTENDS:
        return fe
    name = next((n for n in FRONTENDS if token_dim(n) == dim), "unknown")
    spacing = MusicnnFrontEnd.native_spacing if name == "musicnn" else 1
    return {"name": name, "token_dim": dim, "spacing_hops": spacing,
            "weights": metadata.get("vggish", ""), "random": "random" in str(metadata.get("vggish", ""))}
