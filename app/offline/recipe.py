"""TrainConfig: the training recipe, torch-free, so that the command line reads its defaults
without importing torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    # the recipe of the shipped models (scripts/build_assets.sh); the paper's: lr 1e-5, 50 epochs,
    # patience 10, whole sequences (crop_min 0), which under-trains on a few hundred sequences
    lr: float = 1e-4
    weight_decay: float = 1e-4
    batch_size: int = 32
    epochs: int = 100              # per phase, the most
    patience: int = 15             # early stopping: epochs without a better validation score
    seed: int = 0                  # weights, batch order, start indices
    data_seed: int = 0             # split
    kmeans_tokens: int = 20000     # Q/K tokens per head given to k-means (a random subset)
    crop_min: int = 8              # > 0: each batch is a random contiguous crop of >= this many
                                   # tokens (a live stream answers from its first token, so the
                                   # models must be right on partial windows too); 0: whole sequences
    device: str = "cpu"
