"""`python main.py demo`: synthetic tokens through every variant, in the terminal."""
from __future__ import annotations

from . import command
from .argtypes import POSITIVE, WINDOW


def add_arguments(p) -> None:
    p.add_argument("--steps", type=POSITIVE, default=240, help="tokens (0.25 s each)")
    p.add_argument("--window", type=WINDOW, default=120, help="window n in tokens")
    p.add_argument("--layers", type=int, default=1, choices=(1, 2), help="encoder blocks")
    p.add_argument("--seed", type=int, default=0, help="seed of the tokens and the (shared) weights")


@command("demo", add_arguments)
def run(args) -> int:
    from app.offline.demo import run as demo
    return demo(steps=args.steps, window=args.window, layers=args.layers, seed=args.seed)
