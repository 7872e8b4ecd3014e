"""`python main.py evaluate`: stream every test sequence through trained checkpoints, token by
token (batched across tracks), and measure accuracy, agreement with the batch forward, FLOPs,
latency and state memory (``app/offline/evaluation.py``). ``app/offline/report.py`` writes the report.

Each checkpoint is evaluated on the test sequences recorded in its own metadata (so several data
seeds can be mixed); checkpoints that differ only in their seed are one row (mean ± std).
Costs are measured on one stream (batch 1) of the test tokens joined end to end, 3n steps long,
so the window is full and the continual landmarks cycle several times; "steady" statistics use
the steps after the window filled (t >= n).
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from audio.checksums import file_sha256
from audio.tokens.cache import TokenSet, load_tokens
from app.checkpoint import load_checkpoint
from app.offline.evaluation import Costs, measure_costs, regular_reference, stream_metrics
from models.fused import default_fused

from .progress import Progress
from .train import make_splits

class EvaluateError(ValueError):
    """Evaluation cannot run: checkpoints that do not fit the token file, or bad options."""


@dataclass
class CheckpointResult:
    path: str
    seed: int
    accuracy: float                 # at the last step of each test sequence
    per_class: list[float]          # (C,) recall
    confusion: list[list[int]]      # (C, C) rows: true class, columns: predicted
    accuracy_by_step: list[float]   # (shortest test sequence,) accuracy after each step
    agreement: float                # streaming vs batch argmax at the last step
    max_logit_diff: float           # streaming vs batch logits
    test_size: int


@dataclass
class ModelResult:
    key: str
    name: str
    config: dict
    checkpoints: list[CheckpointResult] = field(default_factory=list)
    costs: Costs | None = None
    regular_flops: dict | None = None     # steady means of a regular model of the same shape

    def summary(self) -> dict:
        acc = [c.accuracy for c in self.checkpoints]
        costs = self.costs.summary()
        return {
            "key": self.key, "name": self.name, "seeds": [c.seed for c in self.checkpoints],
            "accuracy_mean": statistics.fmean(acc),
            "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "accuracies": acc,
            "per_class": np.mean([c.per_class for c in self.checkpoints], axis=0).tolist(),
            "agreement_min": min(c.agreement for c in self.checkpoints),
            "max_logit_diff": max(c.max_logit_diff for c in self.checkpoints),
            **costs,
            "relative_sda_flops": costs["sda_flops_mean"] / self.regular_flops["sda"],
            "relative_model_flops": costs["model_flops_mean"] / self.regular_flops["model"],
        }


# ----------------------------------------------------------------------------- evaluation

def test_indices(tokens: TokenSet, payload: dict, path: str, data_seed: int) -> np.ndarray:
    """The checkpoint's own test sequences (by track id), or the seeded split if it has none."""
    ids = payload.get("metadata", {}).get("split", {}).get("test")
    if ids is None:
        return make_splits(tokens, data_seed)["test"]
    where = {str(t): i for i, t in enumerate(tokens.ids)}
    missing = [t for t in ids if t not in where]
    if missing:
        raise EvaluateError(f"{path} was tested on {len(missing)} track(s) this token file does "
                            f"not hold (e.g. {missing[0]!r}); was it trained on another token file?")
    return np.array(sorted(where[t] for t in ids), dtype=np.int64)


def evaluate_checkpoint(model, payload, path, tokens: TokenSet, X: torch.Tensor,
                        idx: np.ndarray) -> CheckpointResult:
    m = stream_metrics(model, X, torch.as_tensor(tokens.labels), tokens.lengths, idx)
    return CheckpointResult(path=str(path), seed=int(payload.get("metadata", {}).get("seed", -1)),
                            test_size=len(idx), **m)


def results_of_checkpoint(path, tokens, X, sha, genres, variant, data_seed, allow_other_data,
                          results: dict, progress) -> None:
    """Evaluate one checkpoint into ``results`` (one ModelResult per model shape and landmark
    mode, its costs measured once)."""
    model, payload = load_checkpoint(path, variant=variant, in_dim=tokens.X.shape[2], classes=genres)
    model.use_fused(default_fused(model.embed.weight.device))   # the compiled CPU step
    trained_on = payload.get("metadata", {}).get("data", {}).get("sha256")
    if trained_on and trained_on != sha and not allow_other_data:
        raise EvaluateError(f"{path} was trained on another token file (sha256 {trained_on[:12]}…, "
                            f"this one is {sha[:12]}…); pass --allow-other-data to evaluate anyway")
    if tokens.X.shape[1] > model.cfg.window:
        progress.say(f"note: {path} has window {model.cfg.window} < sequence length "
                     f"{tokens.X.shape[1]}; the last-step prediction sees the final "
                     f"{model.cfg.window} tokens")
    idx = test_indices(tokens, payload, path, data_seed)
    t0 = time.monotonic()
    res = evaluate_checkpoint(model, payload, path, tokens, X, idx)
    cfg = model.cfg
    key = cfg.replace(dropout=0.0)            # one row per model shape and landmark mode
    if key not in results:
        steps = 3 * model.cfg.window
        stream = torch.cat([X[i, :tokens.lengths[i]] for i in idx])
        results[key] = ModelResult(cfg.table_row, cfg.description, cfg.to_dict(),
                                   costs=measure_costs(model, stream, steps),
                                   regular_flops=regular_reference(model.cfg, steps))
    results[key].checkpoints.append(res)
    progress.step(f"{cfg.description} seed {res.seed}: accuracy {res.accuracy:.2%} on "
                  f"{res.test_size} test sequences, streaming = batch on {res.agreement:.1%} "
                  f"(max logit diff {res.max_logit_diff:.1e}), {time.monotonic() - t0:.1f} s")


def split_text(tokens: TokenSet, data_seed: int) -> str:
    """How the test sequences were chosen, for the report."""
    own = bool(set(tokens.split.tolist()) - {""})
    return ("by file (a file is one sequence): " + ("the token file's own train/test split" if own else
            "a stratified 72/18/10 train/val/test split, seeded") + "; each checkpoint is scored on the test "
            f"files it recorded when it was trained (else those of data seed {data_seed})")


def evaluate(tokens_path: str, checkpoints: list[str], *, variant: str | None = None,
             data_seed: int = 0, allow_other_data: bool = False,
             log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Evaluate ``checkpoints`` on ``tokens_path``; returns the report dict (see app/offline/report.py)."""
    if not checkpoints:
        raise EvaluateError("give at least one --checkpoint")
    t_start = time.monotonic()
    tokens = load_tokens(tokens_path)
    sha = file_sha256(tokens_path)
    X = torch.as_tensor(tokens.X)
    genres = list(tokens.genres)
    results: dict[str, ModelResult] = {}
    with Progress(len(checkpoints), "evaluate", "checkpoint", log) as progress:
        for path in checkpoints:
            results_of_checkpoint(path, tokens, X, sha, genres, variant, data_seed,
                                  allow_other_data, results, progress)
    return {
        "tokens": {"file": str(tokens_path), "sha256": sha, "shape": list(tokens.X.shape),
                   "metadata": tokens.metadata, "genres": genres, "split": split_text(tokens, data_seed)},
        "models": [{"summary": r.summary(), "config": r.config,
                    "checkpoints": [c.__dict__ for c in r.checkpoints],
                    "costs": r.costs.__dict__} for r in results.values()],
        "seconds": time.monotonic() - t_start,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
