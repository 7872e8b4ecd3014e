"""`python main.py evaluate`: stream test sequences through checkpoints and write a report
(app/offline/evaluate.py, app/offline/report.py)."""
from __future__ import annotations

import sys

from . import command, error
from .argtypes import writable_dir


def add_arguments(p) -> None:
    p.add_argument("--tokens", required=True, help="token file (python main.py extract)")
    p.add_argument("--checkpoint", action="append", required=True, metavar="CKPT",
                   help="a trained checkpoint; repeat (several seeds of one model form one row)")
    p.add_argument("--report", required=True, metavar="DIR", type=writable_dir, help="folder for report.md/.json/PNGs")
    p.add_argument("--variant", default=None, help="refuse checkpoints of other variants")
    p.add_argument("--data-seed", type=int, default=0, help="split for checkpoints without one")
    p.add_argument("--allow-other-data", action="store_true",
                   help="evaluate checkpoints trained on another token file")
    p.add_argument("--title", default="Nystream evaluation", help="report title")
    p.add_argument("--command-line", default=None, help="commands to print in the report")


@command("evaluate", add_arguments)
def run(args) -> int:
    from app.offline.evaluate import EvaluateError, evaluate
    from app.offline.report import write_report
    from audio.tokens.cache import TokenFileError
    from app.checkpoint import CheckpointError
    try:
        report = evaluate(args.tokens, args.checkpoint, variant=args.variant,
                          data_seed=args.data_seed, allow_other_data=args.allow_other_data)
        paths = write_report(report, args.report, title=args.title, commands=args.command_line)
        print(f"evaluated {len(args.checkpoint)} checkpoint(s) in {report['seconds']:.1f} s; "
              f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
        return 0
    except (EvaluateError, TokenFileError, CheckpointError) as e:
        return error(e)

