"""Command line: `python main.py [gui|classify|extract|train|evaluate|bench|demo] ...`."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="main.py", description=__doc__)
    sub = p.add_subparsers(dest="command")
    from app import audio_accuracy, classify, evaluate, extract, train
    from app.gui import launch
    g = sub.add_parser("gui", help="the desktop window (the default command)")
    launch.add_arguments(g)
    b = sub.add_parser("bench", help="per-step latency of every variant vs torch recompute")
    b.add_argument("--windows", default="30,120,480,1920", help="comma-separated n values")
    b.add_argument("--steps", type=int, default=2000, help="timed steps per row (max)")
    b.add_argument("--budget", type=float, default=6.0, help="seconds per row (max)")
    b.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    b.add_argument("--out", default="bench_results/bench.md", help="Markdown output (JSON beside)")
    b.add_argument("--gui", type=float, metavar="SECONDS",
                   help="instead: the live window with 6 models on the demo signal for SECONDS")
    b.add_argument("--evaluate", action="store_true",
                   help="instead: time `evaluate` on 300 sequences x 120 steps x 6 models")
    b.add_argument("--vggish-weights", help="VGGish weights for --gui (default: random)")
    b.add_argument("--frontend", choices=("musicnn", "vggish", "all"), default="all",
                   help="front end(s) whose per-hop cost is measured")
    b.add_argument("--frontend-only", action="store_true", help="only the front-end rows")
    c = sub.add_parser("classify", help="classify a file, the microphone or the demo signal")
    classify.add_arguments(c)
    e = sub.add_parser("extract", help="GTZAN audio (or musicnn taggrams) -> a token file")
    extract.add_arguments(e)
    t = sub.add_parser("train", help="train one variant on a token file (two phases for fixed landmarks)")
    train.add_arguments(t)
    v = sub.add_parser("evaluate", help="stream test sequences through checkpoints; write a report")
    evaluate.add_arguments(v)
    a = sub.add_parser("accuracy", help="genre accuracy from audio files through the live path")
    audio_accuracy.add_arguments(a)
    d = sub.add_parser("demo", help="stream synthetic tokens through every variant (terminal)")
    d.add_argument("--steps", type=int, default=240, help="tokens (0.25 s each)")
    d.add_argument("--window", type=int, default=120)
    d.add_argument("--layers", type=int, default=1, choices=(1, 2))
    d.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:        # the default run: the window, every variant
        from app.gui.launch import has_display
        if has_display():
            args = build_parser().parse_args(["gui"])
        else:
            print("# no display (DISPLAY/WAYLAND_DISPLAY unset): classifying the demo signal in the "
                  "terminal instead of opening the window", file=sys.stderr)
            args = build_parser().parse_args(["classify", "--demo", "--realtime", "--fallback-random-vggish"])
    command = args.command
    if command == "gui":
        from app.gui import launch
        return launch.run(args)
    if command == "bench" and (args.gui or args.evaluate):
        from app import bench_live
        return bench_live.main(args.gui, args.evaluate, args.vggish_weights,
                               "vggish" if args.frontend == "vggish" else "musicnn")
    if command == "bench":
        from app import bench
        windows = tuple(int(w) for w in args.windows.split(","))
        bench.run(windows, steps=args.steps, budget_s=args.budget, out=args.out, threads=args.threads,
                  frontends=("musicnn", "vggish") if args.frontend == "all" else (args.frontend,),
                  frontend_only=args.frontend_only)
        return 0
    if command == "extract":
        from app import extract
        return extract.run(args)
    if command == "train":
        from app import train
        return train.run(args)
    if command == "evaluate":
        from app import evaluate
        return evaluate.run(args)
    if command == "accuracy":
        from app import audio_accuracy
        return audio_accuracy.run(args)
    if command == "classify":
        from app import classify
        return classify.run(args)
    from app import demo
    return demo.run(steps=args.steps, window=args.window, layers=args.layers, seed=args.seed)
