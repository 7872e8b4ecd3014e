"""An exported streaming step (`python main.py export`, app/offline/onnx_export.py) run by ONNX Runtime,
with the streaming interface of GenreTransformer (reset / step / step_flops / state_nbytes /
landmark_mode / landmark_updated / window_full), so that the engine, `classify --onnx` and the
window run it beside the torch models. One intra-op thread, the CPU execution provider, batch 1.

The state lives here as the graph's own numpy arrays, fed back each step; a deep copy (one
stream per interleaved phase, models/interleaved.py) shares the session and has its own state.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from models import flops as F
from models.config import ModelConfig

NUMPY = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(int64)": np.int64}


class OnnxModelError(ValueError):
    """A file that is not a Nystream streaming-step export, or cannot be loaded."""


class OnnxStep(nn.Module):
    switchable = False                   # its landmarks are the ones it was exported with

    def __init__(self, path: str | Path, threads: int = 1):
        super().__init__()
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise OnnxModelError(f"ONNX model not found: {path}")
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.log_severity_level = 3
        try:
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - protobuf and graph errors: not a model
            raise OnnxModelError(f"{path} is not a readable ONNX model ({' '.join(str(e).split())[:200]})") from e
        meta = session.get_modelmeta().custom_metadata_map
        if meta.get("nystream") != "stream-step":
            raise OnnxModelError(f"{path} is not a Nystream streaming-step export "
                                 f"(python main.py export --checkpoint CKPT --onnx OUT.onnx)")
        self.path, self.session = path, session
        self.kind = meta["kind"]
        self.cfg = ModelConfig(**json.loads(meta["config"]))
        self.classes = tuple(json.loads(meta["classes"]))
        self.frontend = json.loads(meta["frontend"])
        inputs = session.get_inputs()
        self.names = [i.name for i in inputs]
        self.specs = [(i.name, tuple(i.shape), NUMPY[i.type]) for i in inputs[2:]]
        self.register_buffer("anchor", torch.empty(0))      # where the model lives: the CPU
        self._feed: dict | None = None
        self._events = np.zeros(3, np.int64)
        self._t = 0

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
        """The FLOPs of the step just taken, by the formulas of the torch step (models/flops.py)
        for the events the graph reported; its branch-free rescale counts as a rescale."""
        cfg, t = self.cfg, self._t
        n_t, d, H = min(t, cfg.window), cfg.d_model, cfg.heads
        two, evict, continual = cfg.layers == 2, t > cfg.window, self.landmark_mode == "continual"
        dh, iters = d // H, cfg.pinv_iters
        m = min(cfg.num_landmarks, n_t) if continual else cfg.num_landmarks      # landmarks in use
        rebuilt, replaced, refreshed = (int(x) for x in self._events)
        if cfg.variant == "continual" and two:
            per_head = F.continual_retroactive_sda(n_t, dh, first=t == 1, evict=evict, rescaled=True)
        elif cfg.variant == "continual":
            per_head = F.continual_sda(n_t, dh)
        else:
            event = "rebuild" if rebuilt or t == 1 else "landmark" if replaced else "step"
            per_head = F.continual_nystrom_sda(
                n_t, dh, m, iters, event=event, evict=evict and event != "rebuild",
                retroactive="factored" if two else False, p_rebuilt=event != "step",
                warmup_landmarks=bool(rebuilt) and t < cfg.window, segment_sums=continual,
                rescaled=True)
        sda = H * per_head + F.refresh(refreshed, n_t, dh)
        if not two:
            return F.one_block_step(sda, d, cfg.ff_dim, cfg.in_dim, cfg.num_classes)
        if cfg.variant == "continual":                  # block 1: the newest query over the window
            sda = sda + H * F.continual_sda(n_t, dh)
        else:                                           # new landmarks each step, or fixed ones once
            sda = sda + H * F.windowed_nystrom_sda(n_t, dh, m, iters, landmark_update=continual or t == 1)
        return F.two_block_step(sda, n_t, d, cfg.ff_dim, cfg.in_dim, cfg.num_classes, H,
                                factored=m if cfg.variant == "continual_nystrom" else 0,
                                window_rows=H * (1 if cfg.variant == "continual" else m),
                                segment_landmarks=m if continual else 0)
