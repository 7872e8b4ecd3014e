"""The terminal demo (`python main.py demo`): every attention variant on one token stream, side by side, in a terminal.

The same stream of 128-d tokens (a seeded synthetic stream, 0.25 s per token) stepped through
untrained models of every variant, with per-step FLOPs, latency and agreement with `regular`:
the attention variants compared without audio, a front end or a window.
"""
from __future__ import annotations

import math
import time

import torch

from audio.gtzan import GENRES
from models.landmarks import fit_fixed_landmarks
from models.transformer import ModelConfig, build_model

MODELS = [("regular", None), ("continual", None), ("nystrom", None),
          ("continual_nystrom", None), ("continual_nystrom", "fixed")]


def synthetic_tokens(steps: int, seed: int) -> torch.Tensor:
    """(steps, 128) slowly drifting tokens: a few sinusoids in a random 128-d basis."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(6, 128, generator=g)
    t = torch.arange(steps, dtype=torch.float32).unsqueeze(1)
    freqs = torch.tensor([1 / 40, 1 / 17, 1 / 9, 1 / 5, 1 / 63, 1 / 3])
    coeff = torch.sin(2 * math.pi * t * freqs)
    return coeff @ basis + 0.1 * torch.randn(steps, 128, generator=g)


def run(steps: int = 240, window: int = 120, layers: int = 1, seed: int = 0) -> int:
    tokens = synthetic_tokens(steps, seed)
    models = {}
    for variant, mode in MODELS:
        model = build_model(ModelConfig(variant=variant, window=window, layers=layers),
                            seed=seed).eval()        # same weights for every variant
        if mode == "fixed":
            fit_fixed_landmarks(model, tokens[: min(window, steps)].unsqueeze(0), seed=seed)
        model.reset(1)
        models[variant + ("/fixed" if mode else "")] = model
    print(f"Nystream demo: {steps} synthetic tokens (0.25 s each), window n={window}, {layers} block(s); "
          "all models UNTRAINED (random weights, shared seed): genres are not meaningful, "
          "agreement, FLOPs and latency are.\n")
    names = list(models)
    print(f"{'time':>6} " + " ".join(f"{n[:22]:>24}" for n in names))
    agree = {n: 0 for n in names}
    lat = {n: [] for n in names}
    for t in range(steps):
        row = {}
        for name, model in models.items():
            t0 = time.perf_counter()
            probs = torch.softmax(model.step(tokens[t:t + 1]), dim=-1)[0]
            lat[name].append(time.perf_counter() - t0)
            row[name] = (int(probs.argmax()), float(probs.max()), model.step_flops()["sda"])
        for name in names:
            agree[name] += row[name][0] == row["regular"][0]
        if (t + 1) % 20 == 0 or t == 0:
            cells = [f"{GENRES[g][:7]:>7} {p:.2f} {f / 1e3:8.1f}kF" for g, p, f in row.values()]
            print(f"{(t + 1) * 0.25:5.1f}s " + " ".join(f"{c:>24}" for c in cells))
    print("\nmodel                       agreement with regular   median step   p95 step")
    for name in names:
        xs = sorted(lat[name])
        print(f"{name:<28}{agree[name] / steps:>10.1%}{xs[len(xs) // 2] * 1e6:>16.0f} us"
              f"{xs[int(0.95 * len(xs))] * 1e6:>10.0f} us")
    return 0
