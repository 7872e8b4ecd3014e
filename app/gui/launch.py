"""Opening the window from the command line (app/commands/gui.py)."""
from __future__ import annotations

import os
import signal
import sys


def has_display() -> bool:
    if sys.platform != "linux" or os.environ.get("QT_QPA_PLATFORM"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def launch(args) -> int:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app.runtime.frontend_args import frontend_name, random_seed
    from app.runtime.sources import SourceSpec

    from .ini import IniSettings
    from .window import MainWindow, Options

    if args.source:
        try:
            SourceSpec.parse(args.source)
        except ValueError as e:
            print(f"gui: --source: {e}", file=sys.stderr)
            return 2
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Nystream")
    settings = IniSettings(args.settings) if args.settings else None
    explicit = args.frontend or args.vggish_weights or args.random_vggish
    window = MainWindow(Options(source=args.source, variants=args.variant, checkpoints=args.checkpoint,
                                frontend=frontend_name(args) if explicit else None,
                                vggish_weights=args.vggish_weights, random_vggish=random_seed(args),
                                speed=args.speed),
                        settings)
    window.show()
    stopped = []

    def close_on_signal(signum, _frame):       # SIGINT / SIGTERM: closed as by the user (settings
        stopped.append(signum)                  # saved, the engine process ended), exit 128 + n
        QTimer.singleShot(0, window.close)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, close_on_signal)
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
    if stopped:
        print(f"# stopped by {signal.Signals(stopped[0]).name}", file=sys.stderr)
        return 128 + stopped[0]
    return code
