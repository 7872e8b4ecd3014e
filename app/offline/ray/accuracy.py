"""Per-file work of `accuracy --ray` in Ray Data workers (imported only with ``--ray``).

Each worker builds the front end and loads the checkpoints once, then streams its files through
the same engine as one process (app/offline/accuracy.py file_predictions); the driver writes each
file's predictions atomically as they arrive and assembles them in file order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .extract import FrontEndSpec


class FilePredictions:
    """Ray Data UDF: a batch of {index, path} rows -> each file's predictions (JSON)."""

    def __init__(self, spec: FrontEndSpec, checkpoints: list[str]):
        from app.runtime.lineup import default_lineup
        self.frontend = spec.build()
        self.entries = default_lineup(self.frontend, "cpu", checkpoints=checkpoints, variants=[])

    def __call__(self, batch: dict) -> dict:
        from app.offline.accuracy import file_predictions
        preds = [json.dumps(file_predictions(str(p), self.frontend, self.entries)) for p in batch["path"]]
        return {"index": np.asarray(batch["index"]), "preds": np.array(preds, dtype=object)}


@dataclass
class RayAccuracy:
    spec: FrontEndSpec
    checkpoints: list[str]
    workers: int

    def results(self, indices: list[int], paths: list):
        """(index, predictions) of each file, in the order they finish."""
        if not indices:
            return
        import ray
        rows = [{"index": i, "path": str(p)} for i, p in zip(indices, paths)]
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            FilePredictions, fn_constructor_kwargs={"spec": self.spec, "checkpoints": self.checkpoints},
            batch_size=1, compute=ray.data.ActorPoolStrategy(size=self.workers), num_cpus=1, batch_format="numpy")
        for row in ds.iter_rows():
            yield int(row["index"]), json.loads(row["preds"])
