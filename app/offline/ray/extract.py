"""Per-track work of `extract --ray` in Ray Data workers (imported only with ``--ray``).

Each worker (a class-based UDF: ``__init__`` builds the front end once) decodes its tracks itself
with the streamed decoder, one torch thread per track, and sends back only the tokens. The driver
writes each finished track's part atomically as it arrives (app/offline/extract.py), so a retried
task, a killed worker or a killed driver loses at most the tracks in flight, and a rerun skips
the finished ones. Ray Data returns results in the order they finish; the token file is assembled
in track order afterwards, so it equals the single-process run bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from app.runtime.frontend_args import FrontEndSpec  # noqa: F401 - the spec its callers build


class TrackTokens:
    """Ray Data UDF: a batch of {index, path} rows -> their tokens or skip reasons."""

    def __init__(self, spec: FrontEndSpec):
        self.frontend = spec.build()

    def __call__(self, batch: dict) -> dict:
        from app.offline.extract import track_tokens
        out = {"index": [], "tokens": [], "shape": [], "nonfinite": [], "clipped": [], "skip": [],
               "seconds": []}
        for index, path in zip(batch["index"], batch["path"]):
            r = track_tokens(self.frontend, int(index), str(path))
            tokens = r.tokens if r.tokens is not None else np.zeros((0, 0), np.float32)
            out["index"].append(r.index)
            out["tokens"].append(tokens.tobytes())            # raw float32, exact
            out["shape"].append(np.array(tokens.shape, dtype=np.int64))
            out["nonfinite"].append(r.nonfinite)
            out["clipped"].append(r.clipped)
            out["skip"].append("" if r.skip is None else r.skip)
            out["seconds"].append(r.seconds)
        return {k: np.array(v, dtype=object) if k in ("tokens", "skip") else np.array(v)
                for k, v in out.items()}


@dataclass
class RayJob:
    """Where and how wide: ``workers`` UDF actors (one CPU each) on the connected Ray."""
    spec: FrontEndSpec
    workers: int
    done: list = field(default_factory=list)

    def results(self, indices: list[int], paths: list):
        """TrackResults of ``indices`` (tracks at ``paths``), in the order they finish."""
        from app.offline.extract import TrackResult
        if not indices:
            return
        import ray
        rows = [{"index": i, "path": str(p)} for i, p in zip(indices, paths)]
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            TrackTokens, fn_constructor_kwargs={"spec": self.spec}, batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=self.workers), num_cpus=1, batch_format="numpy")
        # (Ray Data restarts a killed worker and retries its task: its track is computed again)
        for row in ds.iter_rows():
            shape = tuple(int(x) for x in row["shape"])
            skip = str(row["skip"]) or None
            tokens = None if skip else np.frombuffer(row["tokens"], dtype=np.float32).reshape(shape).copy()
            yield TrackResult(int(row["index"]), tokens, int(row["nonfinite"]), int(row["clipped"]),
                              skip, float(row["seconds"]))
