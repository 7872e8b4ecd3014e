"""Subcommands of `nystream` (`python main.py`): their names and one-line help here, in the order
`--help` lists them; each module registers its argument builder and run function with
``@command`` (name, arguments and run live together in that one module). A module is imported
only when its command is used (or every one, for a parser of them all), so `nystream --help`
loads no torch."""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Callable

HELP = {
    "gui": "the desktop window (the default command)",
    "classify": "classify files, folders, the microphone or the demo signal",
    "serve": "classify live audio from WebSocket clients (protocol v1, docs/serve.md)",
    "listen": "stream a file, the demo or the microphone to a serve server",
    "extract": "labelled audio (GTZAN, or your own: a folder per class) or musicnn taggrams -> a token file",
    "train": "train one variant on a token file (two phases for fixed landmarks)",
    "evaluate": "stream test sequences through checkpoints; write a report",
    "sweep": "train and evaluate a grid of variants x blocks x windows x seeds; one report",
    "export": "export a checkpoint's streaming step to ONNX (explicit state)",
    "accuracy": "genre accuracy from audio files through the live path",
    "bench": "measure: per-step latency of every variant, the window, many streams, the service (docs/benchmarks.md)",
    "demo": "stream synthetic tokens through every variant (terminal)",
    "prepare": "build this machine's compiled forms ahead of the first Start (make run does it)",
}

WITHOUT_TORCH = {"listen"}      # a client: runs where neither torch nor Qt is installed


@dataclass(frozen=True)
class Command:
    name: str
    add_arguments: Callable     # (argparse parser) -> None
    run: Callable               # (argparse Namespace) -> exit code


COMMANDS: dict[str, Command] = {}


def command(name: str, add_arguments: Callable):
    """Register the decorated ``run(args) -> int`` as subcommand ``name``."""
    def register(run: Callable) -> Callable:
        COMMANDS[name] = Command(name, add_arguments, run)
        return run
    return register


def error(e: BaseException | str) -> int:
    """A command's typed error, said in one line; its exit code, 1. Where a stop signal came
    first, the error is what code below made of it (a C extension that called back into Python,
    safetensors' reads among them, turns the stop into an error of its own): the stop is raised
    instead, and the command ends as stopped (130 / 143)."""
    from app.runtime.faults import raise_if_stopped
    raise_if_stopped()
    print(f"error: {e}", file=sys.stderr)
    return 1


def load(name: str) -> Command:
    """The command ``name``, its module imported (it registers itself)."""
    importlib.import_module(f"{__name__}.{name}")
    return COMMANDS[name]
