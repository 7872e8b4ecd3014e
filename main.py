"""Nystream entry point: `python main.py [gui|classify|extract|train|evaluate|bench|demo] ...`."""
import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main())
