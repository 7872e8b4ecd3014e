"""`bench --streams --precision tf32|bf16`: a reduced precision of the musicnn network against
float32 on the same streams, the figures an opt-in precision is judged by: the largest taggram
difference, the models' largest probability difference, the share of model steps whose top
genre changes, and the verdicts (the genre most often on top, per stream and model) that change.
The streams: the GTZAN excerpts of ../shared/data when present (one stream each, 30 s), else the
demo signal (seeds 0..63, 30 s)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

EXCERPTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gtzan_excerpts"
DEMO_STREAMS, DEMO_SECONDS = 64, 30.0


def study_sources() -> tuple[list, str]:
    """(source factories, what they are): the shared GTZAN excerpts, else the demo signal."""
    from audio.sources import FileSource

    from .streams import demo_stream
    files = sorted(EXCERPTS.glob("*.wav")) if EXCERPTS.is_dir() else []
    if files:
        return [lambda f=f: FileSource(f) for f in files], f"the GTZAN excerpts of ../shared/data, {len(files)} x 30 s"
    return ([lambda i=i: demo_stream(i, DEMO_SECONDS) for i in range(DEMO_STREAMS)],
            f"the demo signal, seeds 0-{DEMO_STREAMS - 1}, {DEMO_SECONDS:g} s each")


def precision_error(device: str, mode: str, models=None, sources=None) -> dict:
    """``mode`` against float32 on ``device``, the same streams through both (``sources``: a list
    of zero-argument source factories, default ``study_sources``): taggrams from each network's
    batched push of the streams' log-mel frames, probabilities, top genres and verdicts from two
    engines with the lineup."""
    from app.runtime.engine import Engine
    from app.runtime.verdict import Tally
    from audio.musicnn import PRECISION_WORDS
    from audio.musicnn.batch import MusicnnBatch
    from audio.musicnn.mel import StreamingMel, log_mel_of_frames

    from .streams import bench_setup
    what = None
    if sources is None:
        sources, what = study_sources()
    streams = len(sources)
    runs, taggrams = {}, {}
    for m in ("float32", mode):
        frontend, entries = bench_setup(device, models, m)
        net, mels = MusicnnBatch(frontend.net, streams), [StreamingMel() for _ in range(streams)]
        hops = [iter(make()) for make in sources]
        for s in range(streams):
            net.reset(s)
        out = []
        while True:
            step = [next(h, None) for h in hops]
            if any(x is None for x in step):
                break
            out.append(net.push(list(range(streams)), [log_mel_of_frames(mel.frames(x)) for mel, x in zip(mels, step)]).cpu())
        taggrams[m] = torch.stack(out)                                          # (hops, S, 50)
        runs[m] = list(Engine(frontend, entries, capacity=streams).run([make() for make in sources]))
    assert [(r.source, r.step) for r in runs["float32"]] == [(r.source, r.step) for r in runs[mode]]
    by_stream = {m: {} for m in runs}
    worst, differ, steps = 0.0, 0, 0
    for a, b in zip(runs["float32"], runs[mode]):
        by_stream["float32"].setdefault(a.source, []).append(a)
        by_stream[mode].setdefault(b.source, []).append(b)
        for name, step in a.models.items():
            worst = max(worst, float(np.abs(np.subtract(step.probabilities, b.models[name].probabilities)).max()))
            differ += step.top[0] != b.models[name].top[0]
            steps += 1
    changed = 0
    for src in by_stream["float32"]:
        a = {v.name: v.genre for v in Tally.of(by_stream["float32"][src]).verdicts()}
        b = {v.name: v.genre for v in Tally.of(by_stream[mode][src]).verdicts()}
        changed += sum(a[k] != b.get(k) for k in a)
    row = {"precision": mode, "sources": what or f"{streams} given sources", "streams": streams,
           "taggram_max_abs": float((taggrams[mode] - taggrams["float32"]).abs().max()),
           "probability_max_abs": worst, "top_differs": differ / max(steps, 1), "steps": steps,
           "verdicts_changed": changed, "verdicts": len(by_stream["float32"]) * len(runs["float32"][0].models)}
    print(f"  {PRECISION_WORDS[mode]} against float32, {streams} streams ({row['sources']}): taggrams differ by at most "
          f"{row['taggram_max_abs']:.2e}, probabilities by {row['probability_max_abs']:.2e}; the top genre differs in "
          f"{row['top_differs']:.2%} of {steps} model steps; {changed} of {row['verdicts']} verdicts change", flush=True)
    return row
