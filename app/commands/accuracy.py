"""`nystream accuracy`: accuracy from audio files through the live path
(app/offline/accuracy.py)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from audio.files import atomic_write_json, atomic_write_text, own_folder

from . import command, error
from .argtypes import POSITIVE, writable_dir
from .extract import add_ray_arguments, ray_workers


def add_arguments(p) -> None:
    p.add_argument("--audio", required=True, metavar="DIR",
                   help="folder of <genre>.<nnnnn>.wav files (GTZAN's names), or of a sub-folder per class "
                        "named as the models' classes (the layout extract --folders reads)")
    p.add_argument("--frontend", default="musicnn", choices=("musicnn", "vggish"),
                   help="front end that turns the audio into tokens (its shipped models are scored)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="FILE",
                   help="a model to score instead of the shipped ones for the front end; repeat for more")
    p.add_argument("--out", default="audio_accuracy", type=writable_dir,
                   help="folder for accuracy.md/.json/confusion.png (`make accuracy`: docs/audio_accuracy)")
    p.add_argument("--limit", type=POSITIVE, default=None, help="only the first N files (for a quick check)")
    p.add_argument("--threads", type=POSITIVE, default=None, help="torch CPU threads")
    p.add_argument("--command-line", default=None, help="command to print in the report")
    add_ray_arguments(p)


@command("accuracy", add_arguments)
def run(args) -> int:
    from app.offline.accuracy import find_files, markdown, plot_confusion, run_files, split_of, summarise
    import torch

    from app.runtime.lineup import default_lineup
    from audio.errors import AudioError
    from audio.frontends import build_frontend
    from app.offline.ray.cluster import RayClusterError
    from audio.checksums import file_sha256
    from app.checkpoint import CheckpointError
    try:
        torch.set_num_threads(args.threads or torch.get_num_threads())
        frontend = build_frontend(args.frontend)
        entries = default_lineup(frontend, "cpu", checkpoints=args.checkpoint, variants=[])
        if not entries:
            print(f"error: no trained {args.frontend} models (assets/models/ or --checkpoint)",
                  file=sys.stderr)
            return 1
        classes = entries[0].classes
        if any(e.classes != classes for e in entries):
            print("error: the models score different classes: "
                  + "; ".join(f"{e.path}: {', '.join(e.classes)}" for e in entries), file=sys.stderr)
            return 1
        files = find_files(args.audio, classes)
        if args.limit:
            files = files[:args.limit]
        if not files:
            print(f"error: no audio to score in {args.audio}: GTZAN-named files (<genre>.<nnnnn>.wav) or a "
                  f"sub-folder per class ({', '.join(classes)})", file=sys.stderr)
            return 1
        for e in entries:
            from app.checkpoint import load_checkpoint
            e.payload = load_checkpoint(e.path)[1]
        log = (lambda s: print(s, file=sys.stderr, flush=True))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        parts = prepare_parts(out / "accuracy.parts", {
            "files": [str(p) for p, _ in files], "frontend": frontend.description,
            "checkpoints": [[str(e.path), file_sha256(e.path)] for e in entries]}, log)
        if args.ray:
            from app.offline.ray.accuracy import RayAccuracy
            from app.offline.ray.cluster import ray_session
            from app.offline.ray.extract import FrontEndSpec
            with ray_session(args.ray) as ray:
                job = RayAccuracy(FrontEndSpec(frontend.name), [str(e.path) for e in entries],
                                  ray_workers(ray, args.workers))
                preds, read, skipped = run_files(files, frontend, entries, log, parts, job)
        else:
            preds, read, skipped = run_files(files, frontend, entries, log, parts)
        files_all, files = files, read
        for i, why in skipped.items():
            log(f"  skipped {files_all[i][1]}: {why}")
        if not read:
            print(f"error: none of the {len(files_all)} files could be read", file=sys.stderr)
            return 1
        rows = summarise(files, preds, split_of(entries), classes)
        command = args.command_line or "python main.py accuracy --audio " + str(args.audio)
        atomic_write_text(out / "accuracy.md", markdown(rows, command, frontend.description))
        atomic_write_json(out / "accuracy.json", {"command": command, "frontend": frontend.description,
                                                  "files": [t for _, t in files], "rows": rows,
                                                  "skipped": {files_all[i][1]: why for i, why in skipped.items()}})
        focus = next((n for n in rows if n.startswith("continual_nystrom | native")), next(iter(rows)))
        plot_confusion(rows, focus, out / "confusion.png", classes)
        print(markdown(rows, command, frontend.description))
        shutil.rmtree(parts)
        return 0
    except (AudioError, CheckpointError, RayClusterError) as e:
        return error(e)


def prepare_parts(parts: Path, manifest: dict, log) -> Path:
    """The folder of finished files' predictions: kept when it belongs to this very run (same
    files, front end and checkpoints), so a rerun resumes; else emptied."""
    mpath = parts / "manifest.json"
    own_folder(parts)                                    # a link or a file there: refused
    try:
        same = json.loads(mpath.read_text()) == manifest
    except (OSError, ValueError):
        same = False
    if not same and parts.exists():
        log(f"{parts} holds another run's results; starting afresh")
        shutil.rmtree(parts)
    own_folder(parts)
    atomic_write_json(mpath, manifest)
    return parts
