"""`python main.py train`: batch training of one variant on a token file, with the paper's
two-phase fixed landmarks (Carreto Picón et al.). The training loop is ``models/training.py``;
this module reads the token file, splits it and writes the checkpoint with its metadata.

Splits: a token file with a predefined 'train'/'test' split (the musicnn converter) keeps its
test set and draws the validation set (20 % of train, stratified, ``--data-seed``) from train;
otherwise the paper's 72/18/10 stratified split with ``--data-seed``.

Fixed landmarks: phase 1 trains with continual (segment-mean) landmarks; then, block by block,
Q/K tokens of the training sequences are clustered per head with k-means into m landmarks, which
are frozen, and phase 2 fine-tunes the weights (``--init CKPT`` skips phase 1).
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from audio.frontends import frontend_of_tokens
from audio.gtzan import stratified_split
from audio.token_cache import TokenFileError, TokenSet, load_tokens
from models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from models.sda import LANDMARK_MODES, VARIANTS
from models.training import TrainConfig, fit, score
from models.transformer import ModelConfig


class TrainError(ValueError):
    """Training cannot start: bad options, or a token file or checkpoint that does not fit."""


# ----------------------------------------------------------------------------- data

def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
        raise TrainError(f"{len(tokens.labels)} sequences are too few for a train/val/test split")
    return parts


def train(tokens: TokenSet, cfg: ModelConfig, tc: TrainConfig, *, init=None, data_sha256: str = "",
          data_name: str = "", log=lambda s: print(s, file=sys.stderr, flush=True)):
    """Train ``cfg`` on ``tokens``; returns (model in eval mode, metadata for the checkpoint).

    cfg.landmark_mode 'fixed' runs both phases (or phase 2 only from ``init``, a trained model).
    """
    if tokens.X.shape[2] != cfg.in_dim:
        raise TrainError(f"tokens are {tokens.X.shape[2]}-d but the model expects {cfg.in_dim}")
    if tokens.X.shape[1] > cfg.window:
        raise TrainError(f"sequences hold up to {tokens.X.shape[1]} tokens but the window is "
                         f"{cfg.window}; use --window {tokens.X.shape[1]} or more")
    splits = make_splits(tokens, tc.data_seed)
    X = torch.as_tensor(tokens.X).to(tc.device)
    labels = torch.as_tensor(tokens.labels)
    t0 = time.monotonic()
    model, history = fit(cfg, X, labels, tokens.lengths, splits, tc, init=init, log=log)
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


# ----------------------------------------------------------------------------- CLI

def add_arguments(p) -> None:
    p.add_argument("--tokens", required=True, help="token file (python main.py extract)")
    p.add_argument("--out", required=True, help="checkpoint to write (.pt)")
    p.add_argument("--variant", default="continual_nystrom", choices=VARIANTS)
    p.add_argument("--landmark-mode", default=None,
                   help="continual|fixed (continual_nystrom), segment|fixed (nystrom)")
    p.add_argument("--landmarks", type=int, default=4, help="m")
    p.add_argument("--layers", type=int, default=1, choices=(1, 2))
    p.add_argument("--window", type=int, default=None, help="n (default: the sequence length)")
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ff-dim", type=int, default=384)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--init", metavar="CKPT", help="start from this checkpoint (e.g. phase 2 only)")
    d = TrainConfig()
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--epochs", type=int, default=d.epochs, help="the most, per phase")
    p.add_argument("--patience", type=int, default=d.patience, help="early-stopping patience")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data-seed", type=int, default=d.data_seed)
    p.add_argument("--kmeans-tokens", type=int, default=d.kmeans_tokens)
    p.add_argument("--crop-min", type=int, default=d.crop_min,
                   help="train on random contiguous crops of at least this many tokens "
                        "(0: whole sequences, the paper's setting)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))


def run(args) -> int:
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise TrainError("--device cuda: CUDA is not available in this torch build/machine")
        modes = LANDMARK_MODES[args.variant]
        if args.landmark_mode not in modes and args.landmark_mode is not None:
            raise TrainError(f"--landmark-mode {args.landmark_mode!r} is not valid for "
                             f"{args.variant!r}; valid: {[m for m in modes if m]}")
        tokens = load_tokens(args.tokens)
        if len(tokens.labels) == 0:
            raise TrainError(f"{args.tokens} holds no sequences")
        window = args.window or tokens.X.shape[1]
        cfg = ModelConfig(variant=args.variant, in_dim=tokens.X.shape[2], d_model=args.d_model,
                          heads=args.heads, ff_dim=args.ff_dim, dropout=args.dropout,
                          window=window, num_landmarks=args.landmarks,
                          landmark_mode=args.landmark_mode, layers=args.layers,
                          num_classes=len(tokens.genres))
        init = None
        if args.init:
            init, _ = load_checkpoint(args.init, variant=args.variant, in_dim=cfg.in_dim,
                                      classes=list(tokens.genres))
            if init.cfg.landmark_mode == "fixed":
                raise CheckpointError(f"{args.init} already has fixed landmarks")
            cfg = ModelConfig(**{**init.cfg.to_dict(), "landmark_mode": args.landmark_mode})
        tc = TrainConfig(lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size,
                         epochs=args.epochs, patience=args.patience, seed=args.seed,
                         data_seed=args.data_seed, kmeans_tokens=args.kmeans_tokens,
                         crop_min=args.crop_min, device=args.device)
        model, meta = train(tokens, cfg, tc, init=init, data_sha256=file_sha256(args.tokens),
                            data_name=Path(args.tokens).name)
        save_checkpoint(model, args.out, classes=list(tokens.genres), metadata=meta,
                        frontend=frontend_of_tokens(tokens.metadata, cfg.in_dim))
        print(json.dumps({"checkpoint": str(args.out), **{k: meta["metrics"][k] for k in
                          ("val_acc", "test_acc", "epochs")}}))
        return 0
    except (TrainError, TokenFileError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no checkpoint written", file=sys.stderr)
        return 130


