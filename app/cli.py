"""Command line: `nystream COMMAND ...` (or `python main.py COMMAND ...`): live music-genre
classification with continual (Nyström) transformers. The subcommands live in app/commands/."""
from __future__ import annotations

import argparse
import sys

from app.commands import HELP, WITHOUT_TORCH, load
from app.runtime.faults import (exit_code, hold_signals, resource_message, restore, signal_name,
                                stop_on_signals, stdout_gone, stop_received, take_held_signals)
from app.runtime.memory import fixed_mmap_threshold
from app.runtime.output_lock import OutputLocked


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, unless the help states it already or there is
    none to state (None, an empty list or string, a flag's False)."""

    def _get_help_string(self, action):
        text, default = action.help or "", action.default
        if "default" in text or default is None or default is False or default in ([], "", argparse.SUPPRESS):
            return text               # (`is`: a default of 0 is stated, though 0 == False)
        if isinstance(default, (tuple, list)):
            default = ",".join(map(str, default))       # as the option takes it: 1,2
        return f"{text} (default: {str(default).replace('%', '%%')})"


def version() -> str:
    """The installed package's version, else the checkout's pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    try:
        return installed("nystream")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path
        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            return tomllib.load(f)["project"]["version"]


def chosen_command(argv: list[str]) -> str:
    """The command ``argv`` names ("" for none: the default run)."""
    return next((a for a in argv if not a.startswith("-")), "")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Given ``argv``, only its command's arguments are built (its module alone is
    imported: `nystream --help` loads no torch); without, every command's."""
    chosen = None if argv is None else chosen_command(argv)
    p = argparse.ArgumentParser(prog="nystream", formatter_class=HelpFormatter,
                                description="live music-genre classification with continual (Nyström) transformers; "
                                            "`nystream COMMAND --help` for a command's options (docs/commands.md)")
    p.add_argument("--version", action="version", version=f"nystream {version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in HELP.items():
        s = sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)
        if chosen is None or chosen == name:
            c = load(name)
            c.add_arguments(s)
            s.set_defaults(run=c.run)
    return p


def default_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The default run: the window with every variant, or the terminal without a display."""
    from app.gui.launch import has_display
    if has_display():
        return build_parser(["gui"]).parse_args(["gui"])
    print("# no display (DISPLAY/WAYLAND_DISPLAY unset): classifying the demo signal in the "
          "terminal instead of opening the window", file=sys.stderr)
    argv = ["classify", "--demo", "--pace", "realtime", "--fallback-random-vggish"]
    return build_parser(argv).parse_args(argv)


def output_of(args) -> str | None:
    """What the command writes (--out, --report, --csv), for an error that names no file."""
    return next((v for k in ("out", "report", "csv") if (v := getattr(args, k, None))), None)


def stopped(e: BaseException) -> int:
    print(f"# stopped by {signal_name(e)}", file=sys.stderr)
    return exit_code(e)


def main(argv: list[str] | None = None) -> int:
    """Run a command. SIGINT and SIGTERM stop it as Ctrl+C does (exit 130 / 143); a resource that
    runs out (a full disk, a quota, a read-only folder) is one line naming it and its path (the
    command's ``--out`` where the error names none)."""
    if argv is None:                   # the process's own command (main.py, `nystream`); a call
        fixed_mmap_threshold()         # from Python leaves its caller's allocator as it was.
                                       # Flat memory over long streams (app/runtime/memory.py)
    hold_signals()                     # (main.py holds them from its start)
    handlers, args = stop_on_signals(), None
    try:
        try:
            # the command's module, and torch where the command will run, are imported while
            # the signals wait: an extension module's init that a signal interrupts can abort the
            # process (torch's did); asking for help or the version, or a client, loads no torch
            words = sys.argv[1:] if argv is None else argv
            parser = build_parser(words)
            if not {"-h", "--help", "--version"} & set(words) and chosen_command(words) not in WITHOUT_TORCH:
                import torch  # noqa: F401
        finally:
            take_held_signals()
        args = parser.parse_args(argv)
        if args.command is None:
            args = default_args(parser)
        return args.run(args)
    except OutputLocked as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:     # a command that has nothing of its own to finish
        return stopped(e)
    except BrokenPipeError:            # `... | head`: the reader has what it wanted
        return stdout_gone()
    except Exception as e:
        if stop_received() is not None:   # a stop that other code turned into another exception
            return stopped(stop_received())
        message = resource_message(e, output_of(args))   # its own path, else the output option
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1
    finally:
        restore(handlers)
