"""The compiled CPU backend of the streaming step: numba kernels (kernels.py, blocks.py) that
take a steady step of every stream in one call on the torch step's own state (models/stream/),
read and written by name, the model step built on them (backend.py), and the compiled
pseudo-inverse (pinv.py). They are compiled at install or beside a running engine, never on a
hop (app/runtime/kernels.py).

Why numba: at ~10k FLOPs a continual Nyström step is a few hundred tiny torch calls, whose
interpreter and dispatch cost far more than the arithmetic; one compiled call does it (`bench`).
The torch step compiled by inductor (``torch.compile``, its events masked so that it compiles
whole) does the same step several times slower than the kernels (docs/benchmarks/design.md) and
compiles for tens of seconds. The torch step stays the definition and the CUDA path.
"""
from __future__ import annotations

import torch


def available() -> bool:
    """numba can be imported (it is a dependency through librosa; the reference works without)."""
    import importlib.util
    return importlib.util.find_spec("numba") is not None


def default_fused(device="cpu") -> bool:
    """The fused step is the default on CPU where numba is available."""
    return torch.device(device).type == "cpu" and available()

