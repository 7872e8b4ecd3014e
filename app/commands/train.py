"""`python main.py train`: train one variant on a token file (app/offline/train.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from app.runtime.faults import exit_code, signal_name
from app.offline.recipe import TrainConfig
from models.variants import LANDMARK_MODES, VARIANTS

from . import command, error
from .argtypes import POSITIVE, WINDOW, add_device_arguments, compute_device, integer, number, writable_file


def add_arguments(p) -> None:
    p.add_argument("--tokens", required=True, help="token file (python main.py extract)")
    p.add_argument("--out", required=True, type=writable_file, help="checkpoint to write (.pt)")
    p.add_argument("--variant", default="continual_nystrom", choices=VARIANTS,
                   help="attention variant to train")
    p.add_argument("--landmark-mode", default=None,
                   help="continual|fixed (continual_nystrom), segment|fixed (nystrom)")
    p.add_argument("--landmarks", type=POSITIVE, default=None, help="m (default 4, at most the window)")
    p.add_argument("--layers", type=int, default=1, choices=(1, 2), help="encoder blocks")
    p.add_argument("--window", type=WINDOW, default=None,
                   help="n (default: the data's typical sequence length, the median, at most the longest)")
    p.add_argument("--d-model", type=POSITIVE, default=192, help="model width d")
    p.add_argument("--heads", type=POSITIVE, default=16, help="attention heads (d must divide by it)")
    p.add_argument("--ff-dim", type=POSITIVE, default=384, help="feed-forward width")
    p.add_argument("--dropout", type=number(0, 0.99), default=0.1, help="dropout rate in training")
    p.add_argument("--init", metavar="CKPT", help="start from this checkpoint (e.g. phase 2 only)")
    d = TrainConfig()
    p.add_argument("--lr", type=number(above=0), default=d.lr, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=number(0), default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--batch-size", type=POSITIVE, default=d.batch_size, help="sequences per batch")
    p.add_argument("--epochs", type=POSITIVE, default=d.epochs, help="the most, per phase")
    p.add_argument("--patience", type=POSITIVE, default=d.patience, help="early-stopping patience")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and batches")
    p.add_argument("--data-seed", type=int, default=d.data_seed,
                   help="seed of the random 72/18/10 split (token files without a predefined one)")
    p.add_argument("--kmeans-tokens", type=POSITIVE, default=d.kmeans_tokens,
                   help="training tokens sampled for the fixed landmarks' k-means, per head")
    p.add_argument("--crop-min", type=integer(0), default=d.crop_min,
                   help="train on random contiguous crops of at least this many tokens (default 8, the "
                        "shipped models' recipe: a live stream answers from its first token; 0: whole "
                        "sequences, the paper's setting)")
    add_device_arguments(p, "where to train", precision=False)


def typical_length(lengths) -> int:
    """The window a model of these sequences gets by default: their median length (a few long
    files do not make every window long)."""
    import numpy as np
    return max(1, int(np.ceil(np.median(lengths))))


@command("train", add_arguments)
def run(args) -> int:
    from app.offline.train import TrainError, train
    from app.runtime.faults import check_room
    from app.runtime.output_lock import output_lock
    from audio.checksums import file_sha256
    from audio.frontends import frontend_of_tokens
    from audio.tokens.cache import TokenFileError, load_tokens
    from app.checkpoint import CheckpointError, checkpoint_bytes, load_checkpoint, save_checkpoint
    from models.transformer import ModelConfig
    try:
        compute_device(args, "train")
        modes = LANDMARK_MODES[args.variant]
        if args.landmark_mode not in modes and args.landmark_mode is not None:
            raise TrainError(f"--landmark-mode {args.landmark_mode!r} is not valid for "
                             f"{args.variant!r}; valid: {[m for m in modes if m]}")
        tokens = load_tokens(args.tokens)
        if len(tokens.labels) == 0:
            raise TrainError(f"{args.tokens} holds no sequences")
        window = args.window or typical_length(tokens.lengths)
        cfg = ModelConfig(variant=args.variant, in_dim=tokens.X.shape[2], d_model=args.d_model,
                          heads=args.heads, ff_dim=args.ff_dim, dropout=args.dropout,
                          window=window, num_landmarks=args.landmarks or min(4, window),
                          landmark_mode=args.landmark_mode, layers=args.layers,
                          num_classes=len(tokens.genres))
        init = None
        if args.init:
            init, _ = load_checkpoint(args.init, variant=args.variant, in_dim=cfg.in_dim,
                                      classes=list(tokens.genres))
            if init.cfg.landmark_mode == "fixed":
                raise CheckpointError(f"{args.init} already has fixed landmarks")
            cfg = init.cfg.replace(landmark_mode=args.landmark_mode)
        tc = TrainConfig(lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size,
                         epochs=args.epochs, patience=args.patience, seed=args.seed,
                         data_seed=args.data_seed, kmeans_tokens=args.kmeans_tokens,
                         crop_min=args.crop_min, device=args.device)
        check_room(args.out, checkpoint_bytes(cfg), "the checkpoint")   # before an hour of training
        with output_lock(args.out, "train"):
            model, meta = train(tokens, cfg, tc, init=init, data_sha256=file_sha256(args.tokens),
                                data_name=Path(args.tokens).name)
            save_checkpoint(model, args.out, classes=list(tokens.genres), metadata=meta,
                            frontend=frontend_of_tokens(tokens.metadata, cfg.in_dim))
        metrics = meta["metrics"]
        print(json.dumps({"checkpoint": str(args.out), "val_acc": round(metrics["val_acc"], 4),
                          "test_acc": round(metrics["test_acc"], 4), "epochs": metrics["epochs"]},
                         allow_nan=False))
        return 0
    except (TrainError, TokenFileError, CheckpointError, ValueError) as e:
        return error(e)
    except KeyboardInterrupt as e:
        print(f"# stopped by {signal_name(e)}: no checkpoint written", file=sys.stderr)
        return exit_code(e)


