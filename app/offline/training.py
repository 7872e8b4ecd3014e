"""Batch training of a GenreTransformer on token sequences (tensors in, model out; no files).

Whole sequences are classified at their last token (the window's newest token, as when
streaming). Sequences of equal length are batched together, so zero padding never enters a
window. Each sequence gets a random position start index (recycling positional encoding), so the
model does not learn absolute positions it will not see when streaming past the period.
AdamW, early stopping on validation accuracy (then loss), best weights restored.
"""
from __future__ import annotations

import copy
import time

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as nnf

from models.landmarks import fit_fixed_landmarks
from models.transformer import GenreTransformer, ModelConfig, build_model

from .recipe import TrainConfig


def length_groups(lengths: np.ndarray, idx: np.ndarray) -> dict[int, np.ndarray]:
    """Sequence length -> the indices in ``idx`` with that length."""
    return {int(L): idx[lengths[idx] == L] for L in np.unique(lengths[idx])}


def batches(lengths: np.ndarray, idx: np.ndarray, batch_size: int, rng: np.random.Generator):
    """Shuffled batches of equal-length sequences: a list of index arrays."""
    out = []
    for group in length_groups(lengths, idx).values():
        group = rng.permutation(group)
        out += [group[i:i + batch_size] for i in range(0, len(group), batch_size)]
    return [out[i] for i in rng.permutation(len(out))]


@torch.no_grad()
def batch_predict(model, X: torch.Tensor, lengths: np.ndarray, idx: np.ndarray,
                  batch_size: int = 256) -> torch.Tensor:
    """Logits (len(idx), classes) of each sequence's last window, as streamed: its last n tokens
    at their positions (the whole sequence, from position 0, when it fits the window)."""
    model.eval()
    logits = torch.empty(len(idx), model.cfg.num_classes)
    pos = {int(j): p for p, j in enumerate(idx)}
    n = model.cfg.window
    for group in length_groups(lengths, idx).values():
        for i in range(0, len(group), batch_size):
            b = group[i:i + batch_size]
            L = int(lengths[b[0]])
            out = model(X[b, max(0, L - n):L], start=max(0, L - n)).float().cpu()
            logits[[pos[int(j)] for j in b]] = out
    return logits


def score(model, X, labels: torch.Tensor, lengths, idx) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of the batch forward on ``idx``."""
    logits = batch_predict(model, X, lengths, idx)
    y = labels[idx]
    return float((logits.argmax(1) == y).float().mean()), float(nnf.cross_entropy(logits, y))


# ----------------------------------------------------------------------------- training

class NonFiniteTrainingError(ValueError):
    """The loss or a gradient stopped being finite: the weights would be poisoned, so training
    stops there and no checkpoint is written."""


def short_rows(rows) -> str:
    rows = [int(r) for r in rows]
    return ", ".join(map(str, rows[:8])) + (f" (+{len(rows) - 8} more)" if len(rows) > 8 else "")


def train_phase(model, X, labels, lengths, splits, tc: TrainConfig, rng, phase: str, log,
                epoch_log=None) -> list[dict]:
    """AdamW with early stopping on validation accuracy (then loss); restores the best weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    period = model.cfg.period
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    best, best_key, since, history = None, None, 0, []
    for epoch in range(1, tc.epochs + 1):
        t0 = time.monotonic()
        model.train()
        total, count = 0.0, 0
        for b in batches(lengths, splits["train"], tc.batch_size, rng):
            x = X[b, :int(lengths[b[0]])]
            if x.shape[1] > model.cfg.window or 0 < tc.crop_min < x.shape[1]:   # a random crop that fits the window
                longest = min(x.shape[1], model.cfg.window)
                shortest = min(tc.crop_min, longest) if tc.crop_min else longest
                size = int(rng.integers(shortest, longest + 1))
                first = int(rng.integers(0, x.shape[1] - size + 1))
                x = x[:, first:first + size]
            start = torch.randint(period, (len(b),), generator=gen).to(x.device)
            logits = model(x, start=start)
            loss = nnf.cross_entropy(logits, labels[b].to(x.device))
            opt.zero_grad(set_to_none=True)
            if not torch.isfinite(loss):
                rows = np.asarray(b)[~torch.isfinite(logits).all(dim=1).cpu().numpy()]
                raise NonFiniteTrainingError(f"[{phase}] epoch {epoch}: the training loss is {loss.item()}; "
                                             f"non-finite outputs on sequences {short_rows(rows if len(rows) else b)}; "
                                             f"training stopped")
            loss.backward()
            if not torch.isfinite(torch.stack([p.grad.abs().amax() for p in params if p.grad is not None])).all():
                bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
                raise NonFiniteTrainingError(f"[{phase}] epoch {epoch}: the gradient of {bad[0]} (and "
                                             f"{len(bad) - 1} more) is not finite on sequences "
                                             f"{short_rows(b)}; training stopped (try a lower --lr)")
            opt.step()
            total, count = total + loss.item() * len(b), count + len(b)
        val_acc, val_loss = score(model, X, labels, lengths, splits["val"])
        row = {"phase": phase, "epoch": epoch, "train_loss": total / max(count, 1),
               "val_acc": val_acc, "val_loss": val_loss, "seconds": time.monotonic() - t0}
        history.append(row)
        key = (val_acc, -val_loss)
        better = best_key is None or key > best_key
        if better:
            best, best_key, since = copy.deepcopy(model.state_dict()), key, 0
        else:
            since += 1
        (epoch_log or log)(f"[{phase}] epoch {epoch:3d}/{tc.epochs}  train loss "
                           f"{row['train_loss']:.4f}  val acc {val_acc:6.2%}  val loss "
                           f"{val_loss:.4f}  {row['seconds']:.1f} s" + ("  *" if better else ""))
        if since >= tc.patience:
            log(f"[{phase}] early stop: no better validation score for {tc.patience} epochs")
            break
    model.load_state_dict(best)
    return history


def with_config(model: GenreTransformer, cfg: ModelConfig) -> GenreTransformer:
    """``model``'s weights and landmarks under the identity ``cfg`` (same shape)."""
    if model.cfg == cfg:
        return model
    out = build_model(cfg, seed=0).to(model.embed.weight.device)   # weights replaced below
    out.load_state_dict(model.state_dict())
    return out.train(model.training)


def fit(cfg: ModelConfig, X: Tensor, labels: Tensor, lengths: np.ndarray, splits: dict[str, np.ndarray],
        tc: TrainConfig, *, init: GenreTransformer | None = None, log=print,
        epoch_log=None) -> tuple[GenreTransformer, list[dict]]:
    """Train a model for ``cfg`` on token sequences; returns (model in eval mode, per-epoch history).

    X: (N, T, in_dim) zero-padded sequences, labels: (N,), lengths: (N,), splits: index arrays
    'train' and 'val'. cfg.landmark_mode 'fixed' runs both phases of Carreto Picón et al.: train
    with continual (segment-mean) landmarks, then k-means landmarks per head and block, frozen,
    and fine-tune; with ``init`` (a trained model) phase 1 is skipped. ``epoch_log`` takes each
    epoch's line instead of ``log`` (e.g. a progress bar that counts epochs).
    """
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    fixed = cfg.landmark_mode == "fixed"
    history: list[dict] = []
    if init is not None:
        model = init.to(tc.device)
        log(f"starting from the given checkpoint ({model.cfg.variant}, "
            f"{model.cfg.layers} block(s), window {model.cfg.window})")
    else:
        model = build_model(cfg.replace(landmark_mode=None)).to(tc.device)   # phase 1: continual
    if init is None or not fixed:
        history += train_phase(model, X, labels, lengths, splits, tc, rng,
                               "phase 1" if fixed else "train", log, epoch_log)
    if fixed:
        train_seqs = [X[g, :L] for L, g in length_groups(lengths, splits["train"]).items()]
        k0 = time.monotonic()
        fit_fixed_landmarks(model, train_seqs, seed=tc.seed, max_tokens=tc.kmeans_tokens)
        model = with_config(model, cfg)      # from here on it is a fixed-landmark model
        log(f"fixed landmarks: k-means per head and block in {time.monotonic() - k0:.1f} s; "
            f"fine-tuning with them frozen")
        history += train_phase(model, X, labels, lengths, splits, tc, rng, "phase 2", log, epoch_log)
    return model.eval(), history
