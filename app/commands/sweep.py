"""`python main.py sweep`: train a grid of models (one process, or Ray Tune with --ray) and write one
evaluation report (app/offline/sweep.py)."""
from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

from app.runtime.faults import exit_code, signal_name
from app.runtime.output_lock import output_lock

from . import command, error
from .argtypes import POSITIVE, integer, number, writable_dir
from .extract import add_ray_arguments


def int_list(text: str) -> tuple[int, ...]:
    import argparse
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    return values


def add_arguments(p) -> None:
    from app.offline.recipe import TrainConfig
    from models.variants import VARIANTS
    p.add_argument("--tokens", required=True, help="token file (python main.py extract)")
    p.add_argument("--out", required=True, type=writable_dir,
                   help="folder for the report (report.md/.json/PNGs)")
    p.add_argument("--work", default=None, type=writable_dir,
                   help="folder for checkpoints/ and Ray Tune's tune/ (default: --out)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants")
    p.add_argument("--layers", default=(1, 2), type=int_list, help="encoder blocks, e.g. 1,2")
    p.add_argument("--windows", default=(), type=int_list, help="n values (default: the sequence length)")
    p.add_argument("--seeds", default=(0, 1, 2), type=int_list, help="training seeds, e.g. 0,1,2")
    p.add_argument("--landmarks", type=POSITIVE, default=4, help="m")
    p.add_argument("--no-fixed", action="store_true",
                   help="skip continual_nystrom's phase 2 with fixed (k-means) landmarks")
    d = TrainConfig()
    p.add_argument("--lr", type=number(above=0), default=d.lr, help="AdamW learning rate")
    p.add_argument("--epochs", type=POSITIVE, default=d.epochs, help="the most, per phase")
    p.add_argument("--patience", type=POSITIVE, default=d.patience, help="early-stopping patience")
    p.add_argument("--batch-size", type=POSITIVE, default=d.batch_size, help="sequences per batch")
    p.add_argument("--crop-min", type=integer(0), default=d.crop_min,
                   help="random contiguous crops of at least this many tokens (0: whole sequences)")
    p.add_argument("--d-model", type=POSITIVE, default=192, help="model width d")
    p.add_argument("--heads", type=POSITIVE, default=16, help="attention heads")
    p.add_argument("--ff-dim", type=POSITIVE, default=384, help="feed-forward width")
    p.add_argument("--title", default="Nystream sweep", help="report title")
    add_ray_arguments(p)


@command("sweep", add_arguments)
def run(args) -> int:
    from app.offline.evaluate import EvaluateError, evaluate
    from app.offline.ray.cluster import RayClusterError
    from app.offline.report import write_report
    from app.offline.sweep import SweepConfig, UntrustedWorkError, run_sweep
    from app.offline.train import TrainError
    from audio.tokens.cache import TokenFileError
    from app.checkpoint import CheckpointError
    from models.sda import VARIANTS
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        print(f"error: --variants {args.variants!r}: valid: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    cfg = SweepConfig(tokens=args.tokens, work=str(args.work or args.out), variants=variants, layers=args.layers,
                      windows=args.windows, seeds=args.seeds, landmarks=args.landmarks,
                      fixed=not args.no_fixed,
                      model={"d_model": args.d_model, "heads": args.heads, "ff_dim": args.ff_dim},
                      train={"lr": args.lr, "epochs": args.epochs, "patience": args.patience,
                             "batch_size": args.batch_size, "crop_min": args.crop_min})
    try:
        with output_lock(cfg.work, "sweep"), output_lock(args.out, "sweep") if args.work else nullcontext():
            checkpoints = run_sweep(cfg, ray_address=args.ray, workers=args.workers)
            report = evaluate(args.tokens, [str(p) for p in checkpoints])
            command_line = "python main.py sweep " + " ".join(sys.argv[2:])
            paths = write_report(report, Path(args.out), title=args.title, commands=command_line)
        print(f"swept {len(checkpoints)} checkpoint(s); wrote {', '.join(str(p) for p in paths)}",
              file=sys.stderr)
        return 0
    except (RayClusterError, TrainError, TokenFileError, CheckpointError, EvaluateError, ValueError,
            UntrustedWorkError) as e:
        return error(e)
    except KeyboardInterrupt as e:
        print(f"# stopped by {signal_name(e)}: finished checkpoints are kept; run the same command "
              f"again to resume", file=sys.stderr)
        return exit_code(e)
