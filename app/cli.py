"""Command line: `python main.py [gui|classify|serve|listen|extract|train|evaluate|accuracy|bench|demo] ...`.
The subcommands register themselves in app/commands/."""
from __future__ import annotations

import argparse
import sys

from app.commands import load_all
from app.runtime.faults import (exit_code, hold_signals, resource_message, restore, signal_name,
                                stop_on_signals, stdout_gone, stop_received, take_held_signals)
from app.runtime.memory import fixed_mmap_threshold
from app.runtime.output_lock import OutputLocked


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, unless the help states it already or there is
    none to state (None, an empty list or string, a flag's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, [], "", False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="main.py", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command")
    for c in load_all().values():
        s = sub.add_parser(c.name, help=c.help, description=c.help, formatter_class=HelpFormatter)
        c.add_arguments(s)
        s.set_defaults(run=c.run)
    return p


def default_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The default run: the window with every variant, or the terminal without a display."""
    from app.gui.launch import has_display
    if has_display():
        return parser.parse_args(["gui"])
    print("# no display (DISPLAY/WAYLAND_DISPLAY unset): classifying the demo signal in the "
          "terminal instead of opening the window", file=sys.stderr)
    return parser.parse_args(["classify", "--demo", "--realtime", "--fallback-random-vggish"])


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
            parser = build_parser()    # the commands' modules: an extension module's init that a
        finally:                       # signal interrupts can abort the process (torch's did)
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
        if stop_received() is not None:   # a stop that an import turned into an ImportError
            return stopped(stop_received())
        message = resource_message(e, output_of(args))   # its own path, else the output option
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1
    finally:
        restore(handlers)
