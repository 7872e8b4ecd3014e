"""`python main.py extract`: GTZAN audio -> a token file, resumable; or the musicnn converter.

Finished tracks are kept in ``<out>.parts/`` (one file per track, written atomically), so a crash
or Ctrl-C loses at most the track in progress and running the same command again resumes. Files
that cannot be decoded (the real GTZAN has one) are skipped and listed in the token file's
metadata and in the final report.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from audio import melspec
from audio.errors import AudioFileError, printable
from audio.gtzan import GENRES, discover, discover_folders
from audio.files import atomic_write, atomic_write_json, atomic_write_text, own_folder
from audio.tokens.cache import TokenFileError, pack, save_tokens

from .progress import Progress

FRONTEND = {"sample_rate": melspec.SAMPLE_RATE, "hop": melspec.HOP, "window": melspec.WIN,
            "frame_step": melspec.STEP, "fft": melspec.FFT, "bands": melspec.BANDS,
            "mel_hz": [melspec.MEL_LOW, melspec.MEL_HIGH], "log_offset": melspec.LOG_OFFSET,
            "patch_frames": melspec.FRAMES}


MUSICNN_GRID = {"sample_rate": 16000, "resampler": "resampy 0.2.2 kaiser_best", "fft": 512,
                "frame_hop": 256, "bands": 96, "patch_frames": 187, "patch_hop_frames": 61}


@dataclass
class TrackResult:
    """What one track gave: its tokens (T, D) and repairs, or why it was skipped."""
    index: int
    tokens: np.ndarray | None = None
    nonfinite: int = 0
    clipped: int = 0
    skip: str | None = None
    seconds: float = 0.0


def track_tokens(frontend, index: int, path) -> TrackResult:
    """One track's tokens on one torch thread, so that they are bit-identical wherever they are
    computed (one process, or any number of Ray workers)."""
    import torch
    threads, t0 = torch.get_num_threads(), time.monotonic()
    torch.set_num_threads(1)
    try:
        tokens, info = frontend.file_tokens(path)
    except AudioFileError as e:
        return TrackResult(index, skip=str(e))
    except MemoryError:
        return TrackResult(index, skip=f"{printable(str(path))} needs more memory than this machine has")
    finally:
        torch.set_num_threads(threads)
    return TrackResult(index, tokens.numpy(), int(info.get("nonfinite", 0)), int(info.get("clipped", 0)),
                       seconds=time.monotonic() - t0)


def write_part(parts: Path, r: TrackResult) -> None:
    """A finished track's part, written atomically (a rerun skips it)."""
    if r.skip is not None:
        atomic_write_text(parts / f"{r.index:05d}.skip", r.skip)
        return
    atomic_write(parts / f"{r.index:05d}.npy", lambda f: np.save(f, r.tokens))
    atomic_write_json(parts / f"{r.index:05d}.json", {"nonfinite": r.nonfinite, "clipped": r.clipped})


def extract_gtzan(gtzan_dir: str | Path, out: str | Path, frontend, batch_size: int = 64,
                  log=lambda s: print(s, file=sys.stderr, flush=True), ray=None, folders: bool = False):
    """Tokens of every GTZAN track under ``gtzan_dir`` into the token file ``out``. ``frontend``:
    a FrontEnd or a VGGish Embedder. VGGish: one token per 0.25 s hop; musicnn: the original
    implementation's grid (one taggram every 61 frames, as in the shared token files).
    ``ray``: a RayJob (app/offline/ray/extract.py) to compute the tracks in Ray Data workers
    instead of here; the token file is the same, bit for bit. ``folders``: ``gtzan_dir`` is a
    user's data set, one sub-folder per class (audio/gtzan.py ``discover_folders``), and the
    token file names those classes."""
    from audio.frontends import as_frontend, frontend_metadata
    frontend = as_frontend(frontend)
    grid = FRONTEND if frontend.name == "vggish" else MUSICNN_GRID
    ignored: list[Path] = []
    tracks, classes = discover_folders(gtzan_dir) if folders else (discover(gtzan_dir, ignored), GENRES)
    out = Path(out)
    parts = out.with_name(out.name + ".parts")
    manifest = {"tracks": [t.track_id for t in tracks], "vggish": frontend.checksum,
                "frontend": grid, "frontend_name": frontend.name}
    resume_parts(parts, manifest, log)
    todo = [i for i in range(len(tracks)) if not (parts / f"{i:05d}.skip").exists()
            and not sound_part(parts / f"{i:05d}.npy", frontend.token_dim, log)]
    if len(todo) < len(tracks):
        log(f"resuming: {len(tracks) - len(todo)} of {len(tracks)} tracks already done")
    results = (ray.results(todo, [tracks[i].path for i in todo]) if ray is not None
               else (track_tokens(frontend, i, tracks[i].path) for i in todo))
    with Progress(len(todo), "extract", "track", log) as progress:
        for r in results:                       # in the order they finish
            write_part(parts, r)
            track = tracks[r.index]
            progress.step(f"[{r.index + 1}/{len(tracks)}] {track.track_id}: " +
                          (f"SKIPPED ({r.skip})" if r.skip is not None
                           else f"{len(r.tokens)} tokens in {r.seconds:.1f} s"))
    seqs, labels, ids, repairs = [], [], [], {}
    skipped = [{"id": str(p.relative_to(gtzan_dir)), "reason": "named like a track but not a file"} for p in ignored]
    for i, track in enumerate(tracks):
        if (parts / f"{i:05d}.skip").exists():
            skipped.append({"id": track.track_id, "reason": (parts / f"{i:05d}.skip").read_text()})
            continue
        seqs.append(np.load(parts / f"{i:05d}.npy"))
        labels.append(track.label)
        ids.append(track.track_id)
        counts = part_counts(parts / f"{i:05d}.json")
        if any(counts.values()):
            repairs[track.track_id] = counts
    tokens = pack(seqs, labels, ids, classes, metadata={
        "source": str(Path(gtzan_dir).resolve()), "layout": "folders" if folders else "gtzan", "frontend": grid, "vggish": frontend.checksum,
        "vggish_description": frontend.description, "skipped": skipped,
        "repaired_samples": repairs,      # per track: non-finite samples zeroed, samples clipped
        "frontend_info": {**frontend_metadata(frontend),
                          "spacing_s": (melspec.HOP / melspec.SAMPLE_RATE if frontend.name == "vggish"
                                        else 61 * 256 / 16000)}})
    save_tokens(out, tokens)
    shutil.rmtree(parts)
    random = (f"; made with {frontend.description}: NOT meaningful for training"
              if frontend.random else "")
    log(f"wrote {out}: {len(seqs)} tracks of {len(classes)} classes ({', '.join(map(printable, classes))}), "
        f"X {tokens.X.shape}, {len(skipped)} skipped{random}"
        + "".join(f"\n  skipped {s['id']}: {s['reason']}" for s in skipped)
        + "".join(f"\n  repaired {t}: {c['nonfinite']} non-finite samples zeroed, {c['clipped']} clipped"
                  for t, c in repairs.items()))
    return tokens


def resume_parts(parts: Path, manifest: dict, log) -> None:
    """Make ``parts`` ready for this extraction: kept when its manifest is this one; set aside
    (renamed, named in the log) when its manifest is damaged, so that everything is recomputed."""
    mpath = parts / "manifest.json"
    own_folder(parts)                                    # a link or a file there: refused
    if mpath.exists():
        try:
            old = json.loads(mpath.read_text())
        except (OSError, ValueError) as e:              # half-written (before writes were atomic)
            aside = parts.with_name(f"{parts.name}.damaged-{int(time.time())}")
            parts.rename(aside)
            log(f"{mpath} is damaged ({type(e).__name__}: {e}); set aside as {aside}, recomputing every track")
        else:
            if old != manifest:
                raise TokenFileError(f"{parts} holds a partial extraction with other tracks or VGGish "
                                     f"weights; delete it or choose another --out")
    own_folder(parts)
    atomic_write_json(mpath, manifest)


def sound_part(path: Path, dim: int, log) -> bool:
    """Whether ``path`` holds a finished track's tokens (T, dim), finite. A damaged one (empty,
    cut short, wrong shape) is renamed ``*.damaged``, named in the log, and recomputed."""
    if not path.exists():
        return False
    try:
        x = np.load(path, allow_pickle=False)
        if x.ndim != 2 or x.shape[1] != dim or not np.isfinite(x).all():
            raise ValueError(f"shape {x.shape}, {'finite' if np.isfinite(x).all() else 'non-finite'}")
    except (OSError, ValueError, EOFError) as e:
        aside = path.with_name(path.name + ".damaged")
        path.replace(aside)
        log(f"{path} is damaged ({type(e).__name__}: {e}); set aside as {aside.name}, recomputing that track")
        return False
    return True


def part_counts(path: Path) -> dict:
    """The repairs of a track's samples recorded beside its part ({} for older parts)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"nonfinite": 0, "clipped": 0}
