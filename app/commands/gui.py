"""`python main.py gui`: the desktop window, optionally scripted (source, models, screenshot)."""
from __future__ import annotations

from app.runtime.frontend_args import add_frontend_arguments
from audio.sources import SPEEDS
from models.variants import VARIANTS

from . import command
from .argtypes import SECONDS, writable_file


def add_arguments(p) -> None:
    p.add_argument("--source", default=None, metavar="demo|mic[:DEVICE]|file:PATH",
                   help="what to start on (default: the last used source, else the demo signal)")
    add_frontend_arguments(p)
    p.add_argument("--variant", action="append", choices=VARIANTS, metavar="VARIANT",
                   help=f"a variant to run ({', '.join(VARIANTS)}); repeat for more (default: all): the "
                        "shipped trained model where one exists for the front end, else an untrained one")
    p.add_argument("--add-model", action="append", default=[], metavar="FILE", dest="checkpoint",
                   help="one more trained model beside the variants: a checkpoint (.pt) or an exported step "
                        "(.onnx, nystream export), run by ONNX Runtime; repeat for more")
    p.add_argument("--speed", type=float, choices=SPEEDS, metavar="X",
                   help=f"playback speed of a file or the demo: {', '.join(f'{x:g}' for x in SPEEDS)} "
                        "(default: the last used, else 1)")
    p.add_argument("--screenshot", metavar="PNG", type=writable_file, help="save a screenshot of the window before quitting")
    p.add_argument("--quit-after", type=SECONDS, metavar="SECONDS", help="quit after this long")
    p.add_argument("--settings", metavar="INI", help="settings file (default: the user's Qt settings)")


@command("gui", add_arguments)
def run(args) -> int:
    from app.gui.launch import launch
    return launch(args)
