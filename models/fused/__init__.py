"""The fused CPU step: numba-compiled kernels (kernels.py) that take a steady streaming step in
one call on the same state as the torch reference (models/sda/), and the whole-model step built
on them (model_step.py).

Why numba: at ~10k FLOPs a continual Nyström step is a few hundred tiny torch calls (~250 us of
interpreter and dispatch); one compiled call does it in a few microseconds (measured in `bench`).
torch.compile was not chosen: its guards and graph breaks on the data-dependent events (rescale,
refresh) cost more than the step. The torch path stays the reference and the CUDA path.
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
