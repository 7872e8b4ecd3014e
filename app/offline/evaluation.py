"""Streaming evaluation of a trained GenreTransformer on token sequences (tensors in; no files).

``stream_metrics`` streams every sequence token by token (batched across sequences of equal
length) and compares with the batch forward; ``measure_costs`` runs one batch-1 stream and
records the FLOPs (formulas checked by tests), latency and state memory of every step.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from .training import batch_predict, length_groups
from models.transformer import ModelConfig, build_model


@dataclass
class Costs:
    sda_flops: list[int]            # per step of the cost stream (batch 1)
    model_flops: list[int]
    latency_ms: list[float]
    landmark_updates: list[bool]    # the step installed a new continual landmark
    state_bytes: int
    window: int

    def steady(self, values):
        return values[self.window:] or values

    def summary(self) -> dict:
        sda, model, lat = self.steady(self.sda_flops), self.steady(self.model_flops), self.steady(self.latency_ms)
        return {"sda_flops_mean": statistics.fmean(sda), "sda_flops_min": min(sda),
                "sda_flops_max": max(sda), "model_flops_mean": statistics.fmean(model),
                "update_steps": sum(self.steady(self.landmark_updates)),
                "steady_steps": len(sda),
                "latency_ms_median": statistics.median(lat),
                "latency_ms_p95": float(np.percentile(lat, 95, method="lower")) if lat else float("nan"),
                "state_bytes": self.state_bytes}


@torch.no_grad()
def stream_logits(model, X: torch.Tensor, lengths: np.ndarray, idx: np.ndarray,
                  batch_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token logits of every sequence in ``idx``, batched across equal-length tracks.

    Returns (per-step argmax (len(idx), T) with -1 after a sequence ends, last-step logits (len(idx), C)).
    """
    T, C = X.shape[1], model.cfg.num_classes
    preds = torch.full((len(idx), T), -1, dtype=torch.long)
    last = torch.empty(len(idx), C)
    pos = {int(j): p for p, j in enumerate(idx)}
    for L, group in length_groups(lengths, idx).items():
        for i in range(0, len(group), batch_size):
            b = group[i:i + batch_size]
            rows = [pos[int(j)] for j in b]
            model.reset(len(b))
            for t in range(L):
                logits = model.step(X[b, t]).float().cpu()
                preds[rows, t] = logits.argmax(1)
            last[rows] = logits
    return preds, last


@torch.no_grad()
def measure_costs(model, tokens: torch.Tensor, steps: int) -> Costs:
    """One batch-1 stream of ``steps`` tokens (cycling ``tokens`` (N, D)): FLOPs, latency, state."""
    model.reset(1)
    sda, total, lat, updates = [], [], [], []
    for t in range(steps):
        x = tokens[t % len(tokens)].unsqueeze(0)
        t0 = time.perf_counter()
        model.step(x)
        lat.append((time.perf_counter() - t0) * 1e3)
        f = model.step_flops()
        sda.append(f["sda"])
        total.append(f["model"])
        updates.append(model.landmark_updated())
    return Costs(sda, total, lat, updates, model.state_nbytes(), model.cfg.window)


def regular_reference(cfg: ModelConfig, steps: int) -> dict:
    """Steady SDA and model FLOPs per step of an untrained `regular` model of the same shape."""
    reg = build_model(cfg.replace(variant="regular", landmark_mode=None), seed=0).eval()
    c = measure_costs(reg, torch.zeros(1, cfg.in_dim), min(steps, cfg.window + 1))
    return {"sda": c.sda_flops[-1], "model": c.model_flops[-1]}


def stream_metrics(model, X: torch.Tensor, labels: torch.Tensor, lengths: np.ndarray,
                   idx: np.ndarray) -> dict:
    """Streamed accuracy of ``model`` on sequences ``idx`` of X (N, T, in_dim), labels (N,).

    Returns accuracy at each sequence's last step, per-class recall (NaN: no test sequence), confusion (true x predicted),
    accuracy after each step up to the shortest sequence, and agreement / largest logit difference
    between the streamed last step and the batch forward.
    """
    y = labels[idx]
    preds, last = stream_logits(model, X, lengths, idx)
    batch = batch_predict(model, X, lengths, idx)
    final = last.argmax(1)
    C = model.cfg.num_classes
    confusion = torch.zeros(C, C, dtype=torch.long)
    confusion.index_put_((y, final), torch.ones_like(y), accumulate=True)
    # only the steps every sequence reaches: a tail of longer sequences is a biased subset
    shortest = int(lengths[idx].min())
    return {"accuracy": float((final == y).float().mean()),
            "per_class": per_class_recall(confusion),
            "confusion": confusion.tolist(),
            "accuracy_by_step": [float((preds[:, t] == y).float().mean()) for t in range(shortest)],
            "agreement": float((final == batch.argmax(1)).float().mean()),
            "max_logit_diff": float((last - batch).abs().max())}


def per_class_recall(confusion: torch.Tensor) -> list[float]:
    """(C, C) true x predicted -> (C,) recall; NaN for a class with no sequence (no data, not 0 %)."""
    count = confusion.sum(1)
    recall = confusion.diag().double() / count.clamp(min=1)
    return torch.where(count > 0, recall, torch.full_like(recall, float("nan"))).tolist()
