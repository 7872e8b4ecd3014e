"""An exported streaming step (`python main.py export`, app/offline/onnx_export.py) run by ONNX Runtime,
with the streaming interface of GenreTransformer (reset / step / step_flops / state_nbytes /
landmark_mode / landmark_updated / window_full), so that the engine, `classify --onnx` and the
window run it beside the torch models. One intra-op thread, the CPU execution provider, batch 1.

The state lives here as the graph's own numpy arrays, fed back each step; a deep copy shares the
session and has its own state (``OnnxBatch``: a copy per stream of the engine).
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from models import flops as F
from app.checkpoint import MAX_FILE_BYTES, check_classes, check_frontend, checked_config
from models.stream.batch import Slots
from models.stream.model import KINDS, state_spec

NUMPY = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(int64)": np.int64}


class OnnxModelError(ValueError):
    """A file that is not a Nystream streaming-step export, or cannot be loaded."""


# ----------------------------------------------------------------------------- the file, checked
# Everything below runs on the file's bytes through the onnx package (protobuf, shape inference),
# before ONNX Runtime sees it: ORT folds constants and allocates initializers when a session is
# made, so a 180-byte graph could take gigabytes there.

STATE_TYPES = {torch.float32: 1, torch.float64: 11, torch.int64: 7}      # onnx TensorProto codes
SIZE_MAKERS = {"ConstantOfShape", "Expand", "Tile", "Range", "Resize", "Upsample", "Pad", "EyeLike",
               "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
               "Bernoulli", "OneHot", "SequenceConstruct", "ConcatFromSequence", "SplitToSequence"}
MAX_META_CHARS = 1 << 16         # a metadata value: a config, ten names, a front end's settings


def checked_file(path: Path) -> dict:
    """The metadata of an exported step at ``path`` ({kind, config, classes, frontend}), once the
    file has passed every check: size, metadata fields, inputs and outputs against the state that
    its config implies, no external data, and no tensor (initializer, constant or any value whose
    shape inference knows) larger than a bound from that state. OnnxModelError (one line) else."""
    import onnx

    if not path.is_file():
        raise OnnxModelError(f"ONNX model not found: {path}")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise OnnxModelError(f"{path} is {size / 2**20:,.0f} MB, over the {MAX_FILE_BYTES / 2**20:,.0f} MB "
                             f"an exported step may have: not loaded")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except PermissionError as e:
        raise OnnxModelError(f"{path} cannot be read: permission denied") from e
    except Exception as e:  # noqa: BLE001 - protobuf errors: not a model
        raise OnnxModelError(f"{path} is not a readable ONNX model ({' '.join(str(e).split())[:200]})") from e
    raw = {p.key: p.value for p in model.metadata_props}
    if raw.get("nystream") != "stream-step":
        raise OnnxModelError(f"{path} is not a Nystream streaming-step export "
                             f"(python main.py export --checkpoint CKPT --onnx OUT.onnx)")
    meta = checked_metadata(path, raw)
    check_signature(path, model.graph, meta)
    check_sizes(path, model, meta)
    return meta


def checked_metadata(path: Path, raw: dict) -> dict:
    def bad(field: str, what: str) -> OnnxModelError:
        return OnnxModelError(f"{path}: metadata '{field}' {what}")

    def field(key: str):
        if key not in raw:
            raise bad(key, "is missing (a Nystream export records kind, config, classes and frontend)")
        if len(raw[key]) > MAX_META_CHARS:
            raise bad(key, f"is {len(raw[key]):,} characters, over {MAX_META_CHARS:,}")
        if key == "kind":
            return raw[key]
        try:
            return json.loads(raw[key])
        except ValueError as e:
            raise bad(key, f"is not JSON ({' '.join(str(e).split())[:80]})") from e

    kind = field("kind")
    if kind not in KINDS:
        raise bad("kind", f"must be one of {', '.join(KINDS)}, got {kind[:40]!r}")
    cfg = checked_config(field("config"), bad)
    if cfg.variant != kind.partition("/")[0]:
        raise bad("kind", f"says {kind!r}, but the config is a {cfg.variant!r} model")
    classes, frontend = field("classes"), field("frontend")
    check_classes(classes, cfg, bad)
    check_frontend(frontend, cfg, bad)
    return {"kind": kind, "config": cfg, "classes": classes, "frontend": frontend}


def check_signature(path: Path, graph, meta: dict) -> None:
    """Inputs token, t, state; outputs logits, t_next, events, next state: names, element types
    and static shapes equal to those an export of this config has."""
    cfg, spec = meta["config"], state_spec(meta["config"], meta["kind"], exported=True)
    want_in = [("token", 1, (1, cfg.in_dim)), ("t", 7, ())] + [
        (s.name, STATE_TYPES[s.dtype], tuple(s.shape)) for s in spec]
    want_out = [("logits", 1, (1, cfg.num_classes)), ("t_next", 7, ()), ("events", 7, (4,))] + [
        (f"next_{s.name}", STATE_TYPES[s.dtype], tuple(s.shape)) for s in spec]
    for what, values, want in (("inputs", graph.input, want_in), ("outputs", graph.output, want_out)):
        got = [(v.name, v.type.tensor_type.elem_type,
                tuple(d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim))
               for v in values]
        if got != want:
            first = next((g, w) for g, w in zip(got + [None] * len(want), want + [None] * len(got)) if g != w)
            raise OnnxModelError(f"{path}: its {what} are not those of a {meta['kind']} step of its config "
                                 f"(expected {first[1]}, found {first[0]})")


def check_sizes(path: Path, model, meta: dict) -> None:
    """No external data; no tensor over the bound: 16x the largest tensor a step of this config
    holds (``size_base``), from the config alone, so that no tensor in the file can raise it."""
    import onnx

    bound = 16 * size_base(meta["config"], meta["kind"])
    graphs = list(all_graphs(model.graph))
    weights = [t for g in graphs for t in g.initializer]
    weights += [a.t for g in graphs for node in g.node for a in node.attribute if a.type == onnx.AttributeProto.TENSOR]
    for t in weights:
        if t.data_location == onnx.TensorProto.EXTERNAL or t.external_data:
            raise OnnxModelError(f"{path}: tensor {t.name[:60]!r} keeps its data in another file; "
                                 f"an exported step is one self-contained file: not loaded")
        if any(d < 0 for d in t.dims) or math.prod(t.dims) > bound:
            raise OnnxModelError(f"{path}: tensor {t.name[:60]!r} has shape {tuple(t.dims)}, over the "
                                 f"{bound:,} elements this model's step can need: not loaded")
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as e:  # noqa: BLE001 - inconsistent shapes: not a step we export
        raise OnnxModelError(f"{path}: its graph's shapes are inconsistent ({' '.join(str(e).split())[:160]})") from e
    known = {}
    for g in all_graphs(inferred.graph):
        for v in list(g.value_info) + list(g.output):
            dims = v.type.tensor_type.shape.dim
            if v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
                known[v.name] = math.prod(d.dim_value for d in dims)
    for name, n in known.items():
        if n > bound:
            raise OnnxModelError(f"{path}: value {name[:60]!r} would hold {n:,} elements, over the "
                                 f"{bound:,} this model's step can need: not loaded")
    for g in all_graphs(inferred.graph):
        for node in g.node:
            if node.op_type in SIZE_MAKERS and any(o and o not in known for o in node.output):
                raise OnnxModelError(f"{path}: node {node.name[:40]!r} ({node.op_type}) makes a tensor "
                                     f"whose size cannot be checked before it runs: not loaded")


def size_base(cfg, kind: str) -> int:
    """Elements of the largest tensor a step of ``cfg`` holds: a state tensor, a weight (d times the
    largest of in_dim, 3d, ff, classes and the position table's period), a window of feed-forward
    activations, or a window of scores per head. Real exports' largest initializer and inferred
    value equal it (tests/app/test_hostile_files.py)."""
    d, n = cfg.d_model, cfg.window
    return max([math.prod(s.shape) for s in state_spec(cfg, kind, exported=True)]
               + [d * max(cfg.in_dim, 3 * d, cfg.ff_dim, cfg.num_classes, cfg.period),
                  n * max(cfg.ff_dim, d), cfg.heads * n * n])


def all_graphs(graph):
    """A graph and every subgraph of its nodes (If branches, loops), recursively."""
    yield graph
    for node in graph.node:
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from all_graphs(sub)


class OnnxStep(nn.Module):
    switchable = False                   # its landmarks are the ones it was exported with

    def __init__(self, path: str | Path, threads: int = 1):
        super().__init__()
        import onnxruntime as ort

        path = Path(path)
        meta = checked_file(path)             # before a session exists: ORT folds constants on load
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.log_severity_level = 3
        try:
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - protobuf and graph errors: not a model
            raise OnnxModelError(f"{path} is not a readable ONNX model ({' '.join(str(e).split())[:200]})") from e
        self.path, self.session = path, session
        self.kind, self.cfg = meta["kind"], meta["config"]
        self.classes, self.frontend = tuple(meta["classes"]), meta["frontend"]
        inputs = session.get_inputs()
        self.names = [i.name for i in inputs]
        self.specs = [(i.name, tuple(i.shape), NUMPY[i.type]) for i in inputs[2:]]
        self.register_buffer("anchor", torch.empty(0))      # where the model lives: the CPU
        self._feed: dict | None = None
        self._events = np.zeros(4, np.int64)
        self._t = 0
        try:                                  # a graph that does not compute this model's step
            self.reset(1)
            self.step(torch.zeros(1, self.cfg.in_dim))
            logits = self.step(torch.zeros(1, self.cfg.in_dim))
        except Exception as e:  # noqa: BLE001 - ORT's errors: not this model's step
            raise OnnxModelError(f"{path}: its graph does not run as a step of the model its metadata "
                                 f"describes ({' '.join(str(e).split())[:160]})") from e
        if tuple(logits.shape) != (1, self.cfg.num_classes) or self._t != 2:
            raise OnnxModelError(f"{path}: its graph answers {tuple(logits.shape)} logits, not "
                                 f"(1, {self.cfg.num_classes})")
        self._feed, self._t = None, 0

    def __deepcopy__(self, memo):
        other = copy.copy(self)
        other._feed, other._t = None, 0
        return other

    # ------------------------------------------------------------------ streaming
    def reset(self, batch_size: int = 1) -> None:
        if batch_size != 1:
            raise ValueError(f"an exported step runs one stream (batch 1), got batch {batch_size}")
        self._feed = {name: np.zeros(shape, dtype) for name, shape, dtype in self.specs}
        self._feed["t"] = np.zeros((), np.int64)
        self._t = 0

    def step(self, token: Tensor) -> Tensor:
        """token (1, in_dim) -> logits (1, classes)."""
        if self._feed is None:
            raise RuntimeError("OnnxStep.step called before reset(1)")
        self._feed["token"] = np.ascontiguousarray(token.detach().cpu().numpy(), dtype=np.float32)
        out = self.session.run(None, self._feed)
        self._feed["t"], self._events = out[1], out[2]
        for (name, _, _), value in zip(self.specs, out[3:]):
            self._feed[name] = value
        self._t += 1
        return torch.from_numpy(out[0])

    def use_fused(self, on: bool = True) -> "OnnxStep":
        return self

    def batch(self, capacity: int) -> "OnnxBatch":
        """Slots for ``capacity`` streams (the engine's, app/runtime/shard.py)."""
        return OnnxBatch(self, capacity)

    @property
    def landmark_mode(self) -> str | None:
        return self.kind.split("/")[1] if "/" in self.kind else None

    @property
    def has_fixed_landmarks(self) -> bool:
        return self.landmark_mode == "fixed"

    def set_landmark_mode(self, mode: str) -> None:
        raise ValueError(f"{self.path.name} is an exported graph: it runs with the "
                         f"{self.landmark_mode} landmarks it was exported with")

    def landmark_updated(self) -> bool:
        return bool(self._events[1])

    def window_full(self) -> bool:
        return self._t >= self.cfg.window

    def state_nbytes(self) -> int:
        return 0 if self._feed is None else sum(self._feed[n].nbytes for n, _, _ in self.specs)

    def step_flops(self) -> dict[str, int]:
        return {k: v.total for k, v in self.step_flops_detail().items()}

    def step_flops_detail(self) -> dict[str, F.Flops]:
        """The FLOPs of the step just taken, by the step's formulas (models/flops.py) for the
        events the graph reported."""
        return F.graph_step(self.cfg, self.landmark_mode, self._t, self._events)


class OnnxBatch(Slots):
    """Slots of an exported step, with the interface of models/stream/batch.StreamBatch: each
    stream its own copy of the step (its own state, the session shared), stepped one after
    another (the graph takes one stream)."""

    def __init__(self, step: OnnxStep, capacity: int):
        super().__init__(capacity)
        self.model, self.cfg = step, step.cfg
        self.copies: list[OnnxStep | None] = [None] * capacity
        self.mode = step.landmark_mode
        self.slot_nbytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in step.specs)
        self._last: list[int] = []

    def join(self) -> int:
        slot = self.take()
        if self.copies[slot] is None:
            self.copies[slot] = copy.deepcopy(self.model)
        self.copies[slot].reset(1)
        return slot

    def step(self, slots, tokens: Tensor) -> Tensor:
        self._last = list(slots.tolist() if isinstance(slots, Tensor) else slots)
        tokens = tokens.detach().cpu()
        return torch.cat([self.copies[slot].step(tokens[i:i + 1]) for i, slot in enumerate(self._last)])

    def steps_flops(self) -> list[dict[str, int]]:
        return [self.copies[slot].step_flops() for slot in self._last]

    def landmark_updates(self) -> list[bool]:
        return [self.copies[slot].landmark_updated() for slot in self._last]

    def windows_full(self) -> list[bool]:
        return [self.copies[slot].window_full() for slot in self._last]

    def set_landmark_mode(self, mode: str) -> None:
        self.model.set_landmark_mode(mode)            # refused: an exported graph keeps its landmarks
