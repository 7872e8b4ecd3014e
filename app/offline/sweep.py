"""`python main.py sweep`: train and evaluate a grid of models, and write one report.

The grid is variants x blocks x windows x seeds (m landmarks for the Nyström variants); each
continual Nyström model also gets its fixed-landmark phase 2 from its phase-1 model. A trial
trains one grid point (and its phase 2) into ``<work>/checkpoints/``, skipping checkpoints that
exist, so an interrupted sweep resumes. Trials run one after the other, or as Ray Tune trials
(one CPU each) with ``--ray``; either way a trial trains on one torch thread, so the same grid
gives the same checkpoints' accuracies. Then every checkpoint is evaluated together (`evaluate`)
into the report: accuracy mean +- std over seeds, SDA and model FLOPs, latency, Table II layout.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

PHASE2 = "continual_nystrom"          # the variant whose fixed landmarks are a phase 2


@dataclass(frozen=True)
class GridPoint:
    variant: str
    layers: int
    window: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}-L{self.layers}-n{self.window}-s{self.seed}"


@dataclass
class SweepConfig:
    tokens: str                                   # token file
    work: str                                     # folder for checkpoints/ and tune/
    variants: tuple[str, ...] = ("regular", "continual", "nystrom", "continual_nystrom")
    layers: tuple[int, ...] = (1, 2)
    windows: tuple[int, ...] = ()                 # () -> the sequence length
    seeds: tuple[int, ...] = (0, 1, 2)
    landmarks: int = 4
    fixed: bool = True                            # phase 2 with fixed landmarks for PHASE2
    model: dict = field(default_factory=dict)     # ModelConfig overrides (d_model, heads, ...)
    train: dict = field(default_factory=dict)     # TrainConfig overrides (lr, epochs, ...)

    def grid(self, seq_len: int) -> list[GridPoint]:
        return [GridPoint(v, l, n, s) for l, n, s, v in itertools.product(
            self.layers, self.windows or (seq_len,), self.seeds, self.variants)]


def checkpoint_paths(cfg: SweepConfig, point: GridPoint) -> list[Path]:
    """The checkpoints a trial writes: phase 1, and phase 2 (fixed landmarks) where it applies."""
    folder = Path(cfg.work) / "checkpoints"
    paths = [folder / f"{point.name}.pt"]
    if cfg.fixed and point.variant == PHASE2:
        paths.append(folder / f"{point.variant}_fixed-L{point.layers}-n{point.window}-s{point.seed}.pt")
    return paths


def run_trial(cfg: SweepConfig, point: GridPoint, log=lambda s: None) -> dict:
    """Train one grid point (and its phase 2) unless its checkpoints exist; their test accuracy."""
    import torch

    from app.offline.train import train
    from audio.checksums import file_sha256
    from audio.frontends import frontend_of_tokens
    from audio.tokens.cache import load_tokens
    from app.checkpoint import load_checkpoint, save_checkpoint
    from app.offline.training import TrainConfig
    from models.transformer import ModelConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # the same arithmetic in one process and in a Ray trial
    try:
        tokens = load_tokens(cfg.tokens)
        sha = file_sha256(cfg.tokens)
        out = {}
        phase1, *phase2 = checkpoint_paths(cfg, point)
        model_cfg = ModelConfig(variant=point.variant, in_dim=tokens.X.shape[2], window=point.window,
                                num_landmarks=cfg.landmarks, layers=point.layers,
                                num_classes=len(tokens.genres), **cfg.model)
        tc = TrainConfig(seed=point.seed, **cfg.train)
        for path, init_from, mode in [(phase1, None, None)] + [(p, phase1, "fixed") for p in phase2]:
            if not path.exists():
                init = load_checkpoint(init_from)[0] if init_from else None
                c = init.cfg.replace(landmark_mode=mode) if init is not None else model_cfg
                model, meta = train(tokens, c, tc, init=init, data_sha256=sha,
                                    data_name=Path(cfg.tokens).name, log=log)
                path.parent.mkdir(parents=True, exist_ok=True)
                save_checkpoint(model, path, classes=list(tokens.genres), metadata=meta,
                                frontend=frontend_of_tokens(tokens.metadata, c.in_dim))
            out[path.name] = load_checkpoint(path)[1]["metadata"]["metrics"]["test_acc"]
        return out
    finally:
        torch.set_num_threads(threads)


def tune_trial(config: dict) -> None:
    """(a Ray Tune trial) One grid point; reports its checkpoints' test accuracies."""
    from ray import tune
    result = run_trial(SweepConfig(**config["sweep"]), GridPoint(**config["point"]))
    tune.report({"test_acc": result})


def run_sweep(cfg: SweepConfig, *, ray_address: str | None = None, workers: int | None = None,
              log=lambda s: print(s, file=sys.stderr, flush=True)) -> list[Path]:
    """Every trial, then the checkpoints in grid order."""
    from audio.tokens.cache import load_tokens

    from .progress import Progress
    points = cfg.grid(load_tokens(cfg.tokens).X.shape[1])
    if ray_address is None:
        with Progress(len(points), "sweep", "trial", log) as progress:
            for p in points:
                acc = run_trial(cfg, p)
                progress.step(f"{p.name}: " + ", ".join(f"{k} test {v:.1%}" for k, v in acc.items()))
    else:
        run_tune(cfg, points, ray_address, workers, log)
    return [path for p in points for path in checkpoint_paths(cfg, p)]


class UntrustedWorkError(RuntimeError):
    """A Ray Tune experiment to restore that someone else could have written."""


def check_trusted(folder: Path) -> None:
    """Ray Tune's restore unpickles the experiment's files (tuner.pkl, trial state): refuse unless
    every file and folder in it is this user's and writable by no one else (--work must be a
    folder only the user writes; docs/bad-input.md)."""
    uid = os.getuid()
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in [""] + dirs + files:
            p = Path(root) / name
            st = os.lstat(p)
            if st.st_uid != uid or st.st_mode & 0o022 or stat.S_ISLNK(st.st_mode):
                why = ("a link" if stat.S_ISLNK(st.st_mode) else "not yours" if st.st_uid != uid
                       else "writable by others")
                raise UntrustedWorkError(f"{p} is {why}; restoring this Ray Tune experiment would unpickle "
                                         f"its files: remove {folder} or choose another --work")


def run_tune(cfg: SweepConfig, points: list[GridPoint], address: str, workers: int | None, log) -> None:
    """The trials as Ray Tune trials, one CPU each; an interrupted run is restored."""
    from ray import tune

    from .ray.cluster import ray_session
    storage = (Path(cfg.work) / "tune").resolve()
    with ray_session(address) as ray:
        slots = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        trainable = tune.with_resources(tune_trial, {"cpu": 1})
        # one experiment per grid: a rerun of the same grid restores it, another grid starts anew
        grid = json.dumps({"sweep": asdict(cfg), "points": [asdict(p) for p in points]}, sort_keys=True)
        name = "sweep-" + hashlib.sha256(grid.encode()).hexdigest()[:12]
        path = storage / name
        if tune.Tuner.can_restore(str(path)):
            check_trusted(path)                   # Tune's restore unpickles what it finds there
            log(f"restoring this grid's Ray Tune experiment at {path} (finished trials are kept)")
            tuner = tune.Tuner.restore(str(path), trainable, resume_errored=True)
        else:
            space = {"sweep": asdict(cfg), "point": tune.grid_search([asdict(p) for p in points])}
            tuner = tune.Tuner(trainable, param_space=space,
                               tune_config=tune.TuneConfig(max_concurrent_trials=slots),
                               run_config=tune.RunConfig(name=name, storage_path=str(storage),
                                                         verbose=0))
        results = tuner.fit()
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} sweep trial(s) failed; the first: {errors[0]}")
        for r in results:
            point = GridPoint(**r.config["point"])
            log(f"{point.name}: " + ", ".join(f"{k} test {v:.1%}" for k, v in r.metrics["test_acc"].items()))
