"""Export a continual model's streaming step to ONNX (the step: models/stream/model.py, for one
stream, its rare events as ONNX Ifs; here the file, through torch's exporter and its IR): one
graph, inputs ``token``, ``t`` and the state tensors, outputs ``logits``, ``t_next``, ``events``
and ``next_<state>``, with the class names, the front end and the model's config as metadata.

Feeding the ``next_*`` outputs back as the next step's inputs streams; zeros of the inputs'
shapes with t = 0 start a stream (the step replaces the state at t = 0).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from audio.files import atomic_save
from models.stream.model import CONTINUAL, ModelStep, state_spec
from models.stream.model import NotStreamable as NotExportable

OPSET = 18
EXPORTABLE = CONTINUAL


class Exported(nn.Module):
    """One stream's step as the file holds it: ``forward(token (1, in_dim), t (), *state)`` ->
    ``(logits (1, classes), t + 1, events (4,), *next_state)``, the state without its stream
    axis and only the tensors the step reads (``state_spec(..., exported=True)``; the others,
    which a live switch of landmarks would need, are zeros here)."""

    def __init__(self, model):
        super().__init__()
        self.step = ModelStep(model, events="cond")
        self.kind = self.step.kind
        self.spec = state_spec(model.cfg, self.kind, exported=True)
        names = [s.name for s in self.spec]
        full = self.step.spec()
        self.read = [names.index(s.name) if s.name in names else None for s in full]
        for i, s in enumerate(full):
            if s.name not in names:
                self.register_buffer(f"unread_{i}", torch.zeros((1, *s.shape), dtype=s.dtype))

    def initial_state(self) -> list[Tensor]:
        return [torch.zeros(s.shape, dtype=s.dtype) for s in self.spec]

    def forward(self, token: Tensor, t: Tensor, *state: Tensor):
        full = [getattr(self, f"unread_{i}") if j is None else state[j].unsqueeze(0) for i, j in enumerate(self.read)]
        logits, events, *nxt = self.step(token, t.view(1), *full)
        return (logits, t + 1, events[0], *(x[0] for x, j in zip(nxt, self.read) if j is not None))


def export_onnx(model, path: str | Path, *, classes: list[str], frontend: dict,
                metadata: dict | None = None) -> dict:
    """Write ``model``'s step graph to ``path`` (audio.files.atomic_save: beside it, fsynced,
    renamed); returns the metadata it carries. NotExportable for a model without an explicit-state step."""
    path = Path(path)
    graph = Exported(model.cpu().eval()).eval()
    spec = graph.spec
    token = torch.zeros(1, model.cfg.in_dim)
    args = (token, torch.tensor(0, dtype=torch.int64), *graph.initial_state())
    names = ["token", "t"] + [s.name for s in spec]
    outputs = ["logits", "t_next", "events"] + [f"next_{s.name}" for s in spec]
    meta = {"nystream": "stream-step", "kind": graph.kind, "classes": json.dumps(list(classes)),
            "frontend": json.dumps(frontend), "config": json.dumps(model.cfg.to_dict()),
            "state": json.dumps([s.name for s in spec]),
            "usage": "feed next_<state> back as <state>; t = 0 with zero state starts a stream",
            **{k: json.dumps(v) for k, v in (metadata or {}).items()}}
    torch._dynamo.reset()      # shapes of an earlier export in this process are not generalised
    with torch.no_grad(), quiet():
        program = torch.onnx.export(graph, args, dynamo=True, opset_version=OPSET,
                                    input_names=names, output_names=outputs, verbose=False,
                                    optimize=True)
    drop_stack_traces(program.model)
    program.model.metadata_props.update(meta)
    atomic_save(path, lambda tmp: program.save(str(tmp)))
    return meta


def drop_stack_traces(model) -> None:
    """The exporter records each node's torch source and stack trace in the node's metadata:
    dropped, as most of the file's size and nothing a runtime reads."""
    import onnx_ir as ir            # the IR of torch's ONNX exporter (installed with onnxscript)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.metadata_props.clear()
        node.doc_string = None


@contextlib.contextmanager
def quiet():
    """The exporter's progress lines, notes and warnings kept off the terminal (its errors
    still raise)."""
    log = logging.getLogger("torch")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


__all__ = ["export_onnx", "Exported", "NotExportable", "EXPORTABLE"]
