"""`python main.py gui`: the desktop window, optionally scripted (source, models, screenshot)."""
from __future__ import annotations

import os
import sys

from audio.frontends import FRONTENDS
from models.sda import VARIANTS


def add_arguments(p) -> None:
    p.add_argument("--source", default=None, metavar="demo|mic[:DEVICE]|file:PATH",
                   help="what to start on (default: the last used source, else the demo signal)")
    p.add_argument("--frontend", choices=FRONTENDS, default=None,
                   help="token front end (default: the last used, else musicnn, whose weights ship)")
    p.add_argument("--variant", nargs="+", choices=VARIANTS,
                   help="variants to run (default: all): the shipped trained model where one exists "
                        "for the front end, else an untrained one")
    p.add_argument("--checkpoint", nargs="+", default=[], metavar="FILE", help="more trained models to run")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--vggish-weights", help="VGGish state dict (default: env/hub cache/download)")
    w.add_argument("--random-vggish", nargs="?", type=int, const=0, metavar="SEED")
    p.add_argument("--screenshot", metavar="PNG", help="save a screenshot of the window before quitting")
    p.add_argument("--quit-after", type=float, metavar="SECONDS", help="quit after this long")
    p.add_argument("--settings", metavar="INI", help="settings file (default: the user's Qt settings)")


def has_display() -> bool:
    if sys.platform != "linux" or os.environ.get("QT_QPA_PLATFORM"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def run(args) -> int:
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication

    from .window import MainWindow, Options

    if args.source and not (args.source in ("demo", "mic") or args.source.startswith(("mic:", "file:"))):
        print(f"gui: --source must be demo, mic, mic:DEVICE or file:PATH, got {args.source!r}",
              file=sys.stderr)
        return 2
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Nystream")
    settings = QSettings(args.settings, QSettings.IniFormat) if args.settings else None
    window = MainWindow(Options(source=args.source, variants=args.variant, checkpoints=args.checkpoint,
                                frontend=args.frontend or ("vggish" if args.vggish_weights or
                                                           args.random_vggish is not None else None),
                                vggish_weights=args.vggish_weights, random_vggish=args.random_vggish),
                        settings)
    window.show()
    if args.quit_after is not None:
        def finish():
            if args.screenshot:
                ok = window.screenshot(args.screenshot)
                print(f"screenshot {'saved to ' + args.screenshot if ok else 'FAILED'}", file=sys.stderr)
            window.close()
            app.quit()
        QTimer.singleShot(int(args.quit_after * 1000), finish)
    code = app.exec()
    # Tear the window down while Qt is alive: PySide6 + pyqtgraph can crash in interpreter
    # finalisation if widgets are left for the garbage collector.
    window.deleteLater()
    app.processEvents()
    return code
