"""Training from a token file (`python main.py train`): batch training of one variant on a token file, with the paper's
two-phase fixed landmarks (Carreto Picón et al.). The training loop is ``app/offline/training.py``;
this module reads the token file, splits it and writes the checkpoint with its metadata.

Splits: a token file with a predefined 'train'/'test' split (the musicnn converter) keeps its
test set and draws the validation set (20 % of train, stratified, ``--data-seed``) from train;
otherwise the paper's 72/18/10 stratified split with ``--data-seed``.

Fixed landmarks: phase 1 trains with continual (segment-mean) landmarks; then, block by block,
Q/K tokens of the training sequences are clustered per head with k-means into m landmarks, which
are frozen, and phase 2 fine-tunes the weights (``--init CKPT`` skips phase 1).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict

import numpy as np
import torch

from audio.gtzan import stratified_split
from audio.tokens.cache import TokenSet
from app.offline.training import TrainConfig, fit, score
from models.transformer import ModelConfig

from .progress import Progress


class TrainError(ValueError):
    """Training cannot start: bad options, or a token file or checkpoint that does not fit."""


# ----------------------------------------------------------------------------- data

def make_splits(tokens: TokenSet, data_seed: int) -> dict[str, np.ndarray]:
    """Index arrays 'train', 'val', 'test' (see the module docstring)."""
    predefined = set(tokens.split.tolist()) - {""}
    if predefined:
        if "test" not in predefined or "train" not in predefined:
            raise TrainError(f"the token file's split holds {sorted(predefined)}; "
                             f"a predefined split needs 'train' and 'test'")
        test = np.flatnonzero(tokens.split == "test")
        if "val" in predefined:
            return {"train": np.flatnonzero(tokens.split == "train"),
                    "val": np.flatnonzero(tokens.split == "val"), "test": test}
        train_all = np.flatnonzero(tokens.split == "train")
        inner = stratified_split(tokens.labels[train_all], data_seed, (0.8, 0.2, 0.0))
        return {"train": train_all[inner["train"]], "val": train_all[inner["val"]], "test": test}
    parts = stratified_split(tokens.labels, data_seed)
    if min(len(v) for v in parts.values()) == 0:
        largest = int(np.bincount(tokens.labels).max())
        raise TrainError(
            f"{len(tokens.labels)} sequences are too few for the 72/18/10 train/val/test split: "
            f"it needs at least {MIN_PER_GENRE} sequences of one genre (each genre's parts are "
            f"rounded; {MIN_PER_GENRE} x 10 % rounds to one test sequence), and the largest genre "
            f"here has {largest}. Give more tracks, or a token file with a predefined train/test "
            f"split (python main.py extract --musicnn)")
    return parts


MIN_PER_GENRE = 6     # the fewest sequences of one genre that give each split part a sequence


def describe_setup(cfg: ModelConfig, tokens: TokenSet, splits: dict, source: str) -> str:
    """One line: what is about to be trained, on what."""
    mode = f", {cfg.home_landmark_mode} landmarks m = {cfg.num_landmarks}" \
        if "nystrom" in cfg.variant else ""
    sizes = ", ".join(f"{k} {len(v)}" for k, v in splits.items())
    return (f"training {cfg.variant}{mode}, {cfg.layers} block{'s' if cfg.layers > 1 else ''}, "
            f"window n = {cfg.window}, d = {cfg.d_model}, {cfg.heads} heads, on {source}: "
            f"{len(tokens.labels)} sequences of up to {tokens.X.shape[1]} {tokens.X.shape[2]}-d "
            f"tokens, {len(tokens.genres)} genres; split {sizes}")


def train(tokens: TokenSet, cfg: ModelConfig, tc: TrainConfig, *, init=None, data_sha256: str = "",
          data_name: str = "", log=lambda s: print(s, file=sys.stderr, flush=True)):
    """Train ``cfg`` on ``tokens``; returns (model in eval mode, metadata for the checkpoint).

    cfg.landmark_mode 'fixed' runs both phases (or phase 2 only from ``init``, a trained model).
    """
    if tokens.X.shape[2] != cfg.in_dim:
        raise TrainError(f"tokens are {tokens.X.shape[2]}-d but the model expects {cfg.in_dim}")
    splits = make_splits(tokens, tc.data_seed)
    log(describe_setup(cfg, tokens, splits, data_name or "the given tokens") + f"; device {tc.device}, float32")
    unseen = [g for g, c in zip(tokens.genres, np.bincount(tokens.labels[splits["train"]],
                                                             minlength=len(tokens.genres))) if c == 0]
    if unseen:
        log(f"note: the training split holds no sequence of {', '.join(unseen)}: the model will "
            f"not learn to predict {'it' if len(unseen) == 1 else 'them'}")
    X = torch.as_tensor(tokens.X).to(tc.device)
    labels = torch.as_tensor(tokens.labels)
    t0 = time.monotonic()
    phases = 2 if cfg.landmark_mode == "fixed" and init is None else 1
    with Progress(tc.epochs * phases, "train (epochs, at most)", "epoch", log) as progress:
        model, history = fit(cfg, X, labels, tokens.lengths, splits, tc, init=init,
                             log=progress.say, epoch_log=progress.step)
    val_acc, val_loss = score(model, X, labels, tokens.lengths, splits["val"])
    test_acc, test_loss = score(model, X, labels, tokens.lengths, splits["test"])
    log(f"done in {time.monotonic() - t0:.0f} s: val acc {val_acc:.2%}, test acc {test_acc:.2%} "
        f"(batch forward)")
    metadata = {
        "data": {"file": data_name, "sha256": data_sha256, "shape": list(tokens.X.shape),
                 "token_metadata": tokens.metadata},
        "split": {"data_seed": tc.data_seed, "predefined": bool(set(tokens.split.tolist()) - {""}),
                  **{k: tokens.ids[v].tolist() for k, v in splits.items()}},
        "seed": tc.seed, "train_config": asdict(tc), "history": history,
        "metrics": {"val_acc": val_acc, "val_loss": val_loss, "test_acc": test_acc,
                    "test_loss": test_loss, "epochs": len(history),
                    "seconds": time.monotonic() - t0},
        "torch": torch.__version__,
    }
    return model.cpu(), metadata
