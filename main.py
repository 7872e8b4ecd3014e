"""Nystream entry point: `python main.py [gui|classify|extract|train|evaluate|bench|demo] ...`."""
import signal
import sys

if __name__ == "__main__":
    # SIGINT / SIGTERM wait while the command's modules import; app.cli.main takes them from
    # there (a run stopped by one ends as Ctrl+C ends it, never in an import's traceback)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    from app.cli import main
    sys.exit(main())
