"""Subcommands of `python main.py`. Each module here registers its own with ``@command``: name,
help, argument builder and run function live together in that one module; app/cli.py builds the
parser from the registry."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

MODULES = ("gui", "classify", "serve", "listen", "extract", "train", "evaluate", "sweep", "export", "accuracy", "bench", "demo")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable     # (argparse parser) -> None
    run: Callable               # (argparse Namespace) -> exit code


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable):
    """Register the decorated ``run(args) -> int`` as subcommand ``name``."""
    def register(run: Callable) -> Callable:
        COMMANDS[name] = Command(name, help, add_arguments, run)
        return run
    return register


def load_all() -> dict[str, Command]:
    """Import every command module (each registers itself), in the order `--help` lists them."""
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}")
    return {n: COMMANDS[n] for n in MODULES}
