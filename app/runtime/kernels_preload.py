"""Imported by the server the window's engine processes are forked from (app/runtime/
engine_process.py ``PRELOAD``): where this machine's cache holds the compiled kernels, they are
loaded here, once, and every engine process forked after starts with them (a Start after a
killed engine loads nothing). Where the cache lacks them nothing happens here: an engine process
builds them in the background as ``Kernels.request`` says (app/runtime/kernels.py).

The load steps small models through torch on one thread: a pool of OpenMP threads started here
would be lost to every forked child, and the first parallel region there would hang."""
import torch

from .kernels import KERNELS, marker

if marker(KERNELS.root).exists():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        KERNELS.request()
    finally:
        torch.set_num_threads(threads)
