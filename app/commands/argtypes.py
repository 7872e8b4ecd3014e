"""argparse types that validate at parse time: a bad value is a usage error naming the option
(exit 2) before any model loads or any audio is read."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from app.runtime.faults import resource_message
from audio.files import temporary_path
from models.config import MAX_WINDOW


def integer(lo: int = 1, hi: int | None = None):
    """An int in lo..hi (hi None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is out of range: give " + (f"{lo}..{hi}" if hi is not None
                                                                                  else f"{lo} or more"))
        return value
    parse.__name__ = "integer"
    return parse


def number(lo: float | None = None, hi: float | None = None, *, above: float | None = None):
    """A finite float, >= lo (or > above) and <= hi."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"{value:g} must be more than {above:g}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: give {'' if lo is None else f'{lo:g}'}.."
                                             f"{'' if hi is None else f'{hi:g}'}")
        return value
    parse.__name__ = "number"
    return parse


def writable_file(text: str) -> str:
    """A file path whose folder exists and can be written (the file itself is made later)."""
    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    creatable(folder / path.name, text, exists_ok=True)      # a name the file system cannot hold
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file name")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"folder {folder} does not exist (create it first)")
    creatable(temporary_path(folder / path.name), text)      # the name atomic writes go through
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be written: permission denied")
    return text


def writable_file_or_stdout(text: str) -> str:
    """``-`` (standard output) or a ``writable_file``."""
    return text if text == "-" else writable_file(text)


def creatable(probe: Path, text: str, exists_ok: bool = False) -> None:
    """Make and remove ``probe``: a read-only file system, a folder without write permission or
    a name too long for the file system is said now, not after the work (``exists_ok``: only
    look the name up)."""
    try:
        if exists_ok:
            os.lstat(probe)
            return
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return
    except FileNotFoundError:
        if exists_ok:
            return
        if probe.parent.is_dir():        # /proc, /sys: a folder that takes no new files
            raise argparse.ArgumentTypeError(f"{text} cannot be written: folder {probe.parent} takes "
                                             f"no new files") from None
        raise argparse.ArgumentTypeError(f"folder {probe.parent} does not exist (create it first)") from None
    except OSError as e:
        why = resource_message(e) or ("permission denied" if isinstance(e, PermissionError)
                                       else e.strerror or type(e).__name__)
        raise argparse.ArgumentTypeError(f"{text} cannot be written: {why}") from None
    os.unlink(probe)


def writable_dir(text: str) -> str:
    """A folder that exists and can be written, or can be made inside one that can."""
    path = Path(text)
    creatable(path, text, exists_ok=True)                    # a name the file system cannot hold
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{probe} is a file, not a folder")
    creatable(probe / f".nystream-probe.{os.getpid()}", text)   # read-only, no permission
    longest = os.pathconf(probe, "PC_NAME_MAX")
    for name in path.relative_to(probe).parts:              # the folders still to be made
        if len(os.fsencode(name)) > longest:
            raise argparse.ArgumentTypeError(f"{text} cannot be written: file name too long for "
                                             f"the file system ({longest} bytes at most)")
    return text


def writable_path(text: str) -> str:
    """A file path whose folder can be made (bench results: the folder is created)."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file name")
    writable_dir(str(Path(text).parent))
    return text


def window_list(text: str) -> tuple[int, ...]:
    """Comma-separated windows, e.g. '30,120,480'."""
    parse = integer(1, MAX_WINDOW)
    return tuple(parse(part.strip()) for part in text.split(",") if part.strip()) or parse("")


WINDOW = integer(1, MAX_WINDOW)       # tokens
POSITIVE = integer(1)
SECONDS = number(above=0)


def deprecated(old: str, new: str) -> None:
    """The one-line warning of a renamed option, on stderr."""
    print(f"warning: {old} is deprecated and will be removed in the next release; use {new}", file=sys.stderr)


class OldPace(argparse.Action):
    """``--realtime`` / ``--fast``: the old names of ``--pace realtime|fast``, with a warning."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, "pace", nargs=0, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        pace = option_string.lstrip("-")
        deprecated(option_string, f"--pace {pace}")
        namespace.pace = pace


class DeviceOrMicrophone(argparse.Action):
    """``--device cpu|cuda``; where the command has --mic, any other value is the old name of
    ``--input-device NAME`` (with a warning)."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value in ("cpu", "cuda"):
            namespace.device = value
        elif hasattr(namespace, "input_device"):
            deprecated(f"--device {value}", f"--input-device {value} (--device is now cpu or cuda)")
            namespace.input_device = value
        else:
            parser.error(f"argument --device: invalid choice: {value!r} (choose from 'cpu', 'cuda')")


class OldMicrophoneDevice(argparse.Action):
    """``--device NAME`` where a command has no compute device (listen): the old name of
    ``--input-device NAME``, with a warning."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, "input_device", help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, value, option_string=None):
        deprecated(f"--device {value}", f"--input-device {value}")
        namespace.input_device = value


def add_old_pace_names(p) -> None:
    """``--realtime`` and ``--fast``, hidden, for one release."""
    p.add_argument("--realtime", action=OldPace)
    p.add_argument("--fast", action=OldPace)


def add_device_arguments(p, what: str = "where the front end and models run", precision: bool = True) -> None:
    """--device cpu|cuda (compute, the same name in every command) and, if asked, --precision."""
    p.add_argument("--device", action=DeviceOrMicrophone, default="cpu", metavar="{cpu,cuda}", help=what)
    if precision:
        from audio.frontend_names import PRECISIONS
        p.add_argument("--precision", choices=PRECISIONS, default="float32",
                       help="musicnn's arithmetic: float32 (default, exact to float32 rounding); tf32: with "
                            "--device cuda, TF32 with cuDNN; bf16: the continual front end's products that hold "
                            "no state (timbral; temporal where recomputed) in bf16, on a CPU with avx512_bf16 or AMX or a GPU with bf16 tensor cores (their "
                            "speed and error against float32: docs/front-ends.md)")


def compute_device(args, command: str) -> str:
    """``args.device``, checked: CUDA asked for where there is none is an error (exit 1), never
    a run on the CPU; a --precision this device or front end cannot run is one too."""
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{command}: --device cuda: no CUDA device here (torch {torch.__version__}"
                         f"{', a CPU-only build' if torch.version.cuda is None else ''})")
    mode = getattr(args, "precision", "float32")
    if mode != "float32":
        from app.runtime.frontend_args import frontend_name
        from audio.musicnn import precision_problem
        if hasattr(args, "random_vggish") and frontend_name(args) == "vggish":   # (bench --streams: musicnn)
            raise SystemExit(f"{command}: --precision {mode} is for the musicnn front end (VGGish runs float32)")
        problem = precision_problem(mode, args.device, not getattr(args, "recompute_frontend", False))
        if problem:
            raise SystemExit(f"{command}: --{problem}")
    return args.device
