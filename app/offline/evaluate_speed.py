"""`python main.py bench --evaluate`: the evaluation mode (300 synthetic sequences x 120 steps x
6 checkpoints), timed."""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch


def evaluate_speed(sequences: int = 300, steps: int = 120) -> dict:
    from app.offline.evaluate import evaluate
    from app.offline.train import train
    from audio.gtzan import GENRES
    from audio.tokens.cache import pack, save_tokens
    from app.checkpoint import save_checkpoint
    from app.offline.training import TrainConfig
    from models.transformer import ModelConfig

    folder = tempfile.mkdtemp()
    g = np.random.default_rng(0)
    labels = np.arange(sequences * 2) % 10
    seqs = [g.normal(size=(steps, 128)).astype(np.float32) + 0.5 * (np.arange(128) % 10 == c)
            for c in labels]
    split = np.array(["train"] * sequences + ["test"] * sequences)
    tokens = pack(seqs, labels, [f"s{i}" for i in range(len(seqs))], GENRES, split)
    path = os.path.join(folder, "tokens.npz")
    save_tokens(path, tokens)
    ckpts = []
    for variant, mode in (("regular", None), ("continual", None), ("nystrom", None),
                          ("continual_nystrom", None), ("continual_nystrom", "fixed")):
        cfg = ModelConfig(variant=variant, window=steps, landmark_mode=mode)
        model, meta = train(tokens, cfg, TrainConfig(epochs=1, kmeans_tokens=5000), log=lambda s: None)
        ckpts.append(os.path.join(folder, f"{variant}-{mode}.pt"))
        save_checkpoint(model, ckpts[-1], classes=list(GENRES), metadata=meta)
    cfg = ModelConfig(variant="continual", window=steps, layers=2)
    model, meta = train(tokens, cfg, TrainConfig(epochs=1), log=lambda s: None)
    ckpts.append(os.path.join(folder, "continual2.pt"))
    save_checkpoint(model, ckpts[-1], classes=list(GENRES), metadata=meta)
    t0 = time.monotonic()
    evaluate(path, ckpts, log=lambda s: None)
    return {"sequences": sequences, "steps": steps, "models": len(ckpts), "seconds": time.monotonic() - t0,
            "threads": torch.get_num_threads()}
