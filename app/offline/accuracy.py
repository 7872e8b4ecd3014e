"""`nystream accuracy`: accuracy measured from audio, through the app's real path.

Every audio file of a GTZAN-named folder (``<genre>.<nnnnn>.<ext>``), or of a folder with a
sub-folder per class (the layout of `extract --folders`, the classes the models were trained on),
is streamed like
``classify FILE`` (file source, no real-time pacing, the chosen front end computed once per hop,
every model stepping every hop) and the prediction at the end of each file is scored. Each model
runs twice on the same tokens: fed at the spacing it was trained on (interleaved streams, the
app's default) and fed every hop into one stream (the alternative), so the two can be compared.
Files are grouped by where their track sits in the checkpoints' token split: 'train' (training or
validation tracks), 'evaluation' (test tracks) or 'neither'. Writes ``README.md``-ready Markdown,
``accuracy.json`` and ``confusion.png`` to ``--out``.
"""
from __future__ import annotations

import copy
import json
import re
import time
from pathlib import Path

import numpy as np

from audio.gtzan import GENRES

PATTERN = re.compile(r"^(?P<genre>[a-z]+)\.(?P<num>\d{5})\.(wav|au|ogg|flac|mp3)$")


def find_files(folder: str | Path, classes=GENRES) -> list[tuple[Path, str]]:
    """(path, track id as in the token files), sorted: GTZAN-named files (for the GTZAN genres,
    'blues/blues.00012.au'), else the audio files of each sub-folder named after a class
    ('hum/more/a.wav', as `extract --folders` names them)."""
    from audio.decoding import audio_files_under
    out = []
    if tuple(classes) == tuple(GENRES):
        for p in sorted(Path(folder).iterdir()):
            m = PATTERN.match(p.name)
            if m and m["genre"] in GENRES:
                out.append((p, f"{m['genre']}/{m['genre']}.{m['num']}.au"))
        if out:
            return out
    for sub in sorted(p for p in Path(folder).iterdir() if p.is_dir() and p.name in classes):
        files, _ = audio_files_under(sub)
        out += [(f, f"{sub.name}/{f.relative_to(sub).as_posix()}") for f in files]
    return out


def split_of(entries) -> dict[str, str]:
    """track id -> 'train' | 'evaluation' from the checkpoints' metadata (they share one split)."""
    where = {}
    for e in entries:
        split = e.payload["metadata"].get("split", {})
        for key, label in (("train", "train"), ("val", "train"), ("test", "evaluation")):
            for tid in split.get(key, []):
                where.setdefault(tid, label)
    return where


SKIPPED = "skipped"          # the key of a file's predictions that holds why it has none


def file_predictions(path: Path, frontend, entries) -> dict:
    """Stream one file like `classify FILE`; per model and feeding ('native' / 'every hop'), the
    class predicted at its end. On one torch thread, so that it is the same wherever it runs.
    A file that cannot be read gives {SKIPPED: why}, like an unreadable track of `extract`."""
    import torch

    from app.runtime.engine import Engine
    from audio.errors import AudioFileError
    from audio.sources import FileSource
    try:
        return _predictions(path, frontend, entries, Engine, FileSource, torch)
    except AudioFileError as e:
        return {SKIPPED: str(e)}
    except MemoryError:
        return {SKIPPED: f"{path} needs more memory than this machine has"}


def _predictions(path, frontend, entries, Engine, FileSource, torch) -> dict[str, int]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(frontend)
        for e in entries:
            for feed, spacing in (("native", e.spacing), ("every hop", 1)):
                engine.add_model(f"{e.name} | {feed}", copy.deepcopy(e.model), trained=True,
                                 spacing=spacing, frontend=e.frontend, classes=e.classes)
        last = None
        for r in engine.run([FileSource(path)]):
            last = r
        if last is None:
            return {SKIPPED: f"{path} gave no hop of audio"}
        return {name: int(np.argmax(m.probabilities)) for name, m in last.models.items()}
    finally:
        torch.set_num_threads(threads)


def run_files(files, frontend, entries, log, parts: Path | None = None, ray=None) -> tuple[dict, list, dict]:
    """Per model and feeding, the final prediction of each file read (in file order), those files,
    and {file index: why} for the files skipped. ``parts``: a
    folder where each finished file's predictions are written atomically and found again by a
    rerun; ``ray``: a RayAccuracy (app/offline/ray/accuracy.py) to stream the files in Ray workers."""
    from audio.files import atomic_write_json
    done: dict[int, dict] = {}
    if parts is not None:
        for i in range(len(files)):
            try:
                done[i] = json.loads((parts / f"{i:05d}.json").read_text())
            except (OSError, ValueError):
                pass
    todo = [i for i in range(len(files)) if i not in done]
    if len(todo) < len(files):
        log(f"resuming: {len(files) - len(todo)} of {len(files)} files already done")
    results = (ray.results(todo, [files[i][0] for i in todo]) if ray is not None
               else ((i, file_predictions(files[i][0], frontend, entries)) for i in todo))
    t0 = time.monotonic()
    for k, (i, pred) in enumerate(results):
        done[i] = pred
        if parts is not None:
            atomic_write_json(parts / f"{i:05d}.json", pred)
        log(f"[{k + 1}/{len(todo)}] {files[i][0].name} ({time.monotonic() - t0:.0f} s): " + (
            f"SKIPPED ({pred[SKIPPED]})" if SKIPPED in pred else ", ".join(
                f"{n.split(' | ')[0]} {entries[0].classes[p]}" for n, p in pred.items() if n.endswith("native"))))
    preds: dict[str, list[int]] = {}
    skipped = {i: done[i][SKIPPED] for i in range(len(files)) if SKIPPED in done[i]}
    for i in range(len(files)):
        for name, p in done[i].items():
            if i not in skipped:
                preds.setdefault(name, []).append(p)
    return preds, [f for i, f in enumerate(files) if i not in skipped], skipped


def summarise(files, preds, where, classes=GENRES) -> dict:
    labels = np.array([list(classes).index(tid.split("/")[0]) for _, tid in files])
    groups = np.array([where.get(tid, "neither") for _, tid in files])
    rows = {}
    for name, p in preds.items():
        p = np.array(p)
        row = {"all": float((p == labels).mean()), "n_all": len(p)}
        for g in ("train", "evaluation", "neither"):
            mask = groups == g
            row[g] = float((p[mask] == labels[mask]).mean()) if mask.any() else None
            row[f"n_{g}"] = int(mask.sum())
        conf = np.zeros((len(classes), len(classes)), dtype=int)
        np.add.at(conf, (labels, p), 1)
        row["confusion"] = conf.tolist()
        rows[name] = row
    return rows


def markdown(rows: dict, command: str, frontend: str) -> str:
    def pct(x):
        return "—" if x is None else f"{100 * x:.1f}"
    any_row = next(iter(rows.values()))
    lines = [f"Command: `{command}`  ", f"Front end: {frontend}", "",
             f"| model | fed | all ({any_row['n_all']}) | train split ({any_row['n_train']}) | "
             f"evaluation split ({any_row['n_evaluation']}) | neither ({any_row['n_neither']}) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        model, feed = name.split(" | ")
        lines.append(f"| {model} | {feed} | {pct(r['all'])} | {pct(r['train'])} | "
                     f"{pct(r['evaluation'])} | {pct(r['neither'])} |")
    return "\n".join(lines) + "\n"


def plot_confusion(rows: dict, name: str, path: Path, classes=GENRES) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    conf = np.array(rows[name]["confusion"])
    fig, ax = plt.subplots(figsize=(6.4, 5.6), constrained_layout=True)
    ax.imshow(conf, cmap="Blues")
    for i in range(len(classes)):
        for j in range(len(classes)):
            if conf[i, j]:
                ax.text(j, i, conf[i, j], ha="center", va="center",
                        color="white" if conf[i, j] > conf.max() / 2 else "black", fontsize=8)
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted at the end of the file")
    ax.set_ylabel("true class")
    model, feed = name.split(" | ")
    ax.set_title(f"{model} (fed {feed}), from audio: {conf.sum()} files", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
