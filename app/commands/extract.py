"""`python main.py extract`: GTZAN audio (or the musicnn taggram files) -> a token file
(app/offline/extract.py)."""
from __future__ import annotations

import sys
from pathlib import Path

from app.runtime.frontend_args import add_frontend_arguments, device_text
from audio.errors import AudioError

from app.runtime.faults import exit_code, signal_name
from app.runtime.output_lock import output_lock

from . import command, error
from .argtypes import POSITIVE, add_device_arguments, compute_device, writable_file


def add_arguments(p) -> None:
    data = p.add_mutually_exclusive_group()
    data.add_argument("--gtzan", metavar="DIR", help="GTZAN folder (see audio/gtzan.py for layouts)")
    data.add_argument("--folders", metavar="DIR",
                      help="your own labelled audio: one sub-folder of DIR per class, named as the class "
                           "(2 to 1,000 classes; any audio format the app reads, in sub-folders too)")
    data.add_argument("--musicnn", metavar="DIR", help="convert the musicnn GTZAN taggram .npz files")
    p.add_argument("--out", required=True, type=writable_file,
                   help="token file to write (.npz); an existing one is kept unless --force")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing --out (an interrupted extraction resumes without it)")
    add_frontend_arguments(p)
    p.add_argument("--batch-size", type=POSITIVE, default=64, help="VGGish batch size")
    add_device_arguments(p, "where the front end runs", precision=False)
    add_ray_arguments(p)


def add_ray_arguments(p) -> None:
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the per-track work in Ray workers: alone, a local Ray instance on this "
                        "machine's cores; 'auto' or ray://HOST:PORT, a running cluster")
    p.add_argument("--workers", type=POSITIVE, default=None,
                   help="Ray workers, one CPU each (default: the cluster's CPUs less one)")


def ray_workers(ray, asked: int | None) -> int:
    """Workers to start: as asked, else every CPU of the cluster but one (for Ray Data's reads)."""
    return asked or max(1, int(ray.cluster_resources().get("CPU", 1)) - 1)


@command("extract", add_arguments)
def run(args) -> int:
    from app.offline.extract import extract_gtzan
    from app.offline.ray.cluster import RayClusterError
    from app.runtime.frontend_args import frontend_from_args, random_seed
    from audio.tokens.cache import convert_musicnn, save_tokens
    if Path(args.out).exists() and not args.force:
        print(f"extract: {args.out} exists; give --force to overwrite it, or another --out",
              file=sys.stderr)
        return 1
    try:
        if args.musicnn:
            tokens = convert_musicnn(args.musicnn)
            save_tokens(args.out, tokens)
            print(f"wrote {args.out}: {len(tokens.labels)} sequences, X {tokens.X.shape}",
                  file=sys.stderr)
            return 0
        folder = args.gtzan or args.folders
        if not folder:
            print("extract: give --gtzan DIR, --folders DIR or --musicnn DIR", file=sys.stderr)
            return 2
        device = compute_device(args, "extract")
        frontend = frontend_from_args(args, device)
        print(f"# {device_text(device)}; front end: {frontend.description}", file=sys.stderr)
        with output_lock(args.out, "extract"):
            if not args.ray:
                extract_gtzan(folder, args.out, frontend, args.batch_size, folders=bool(args.folders))
                return 0
            from app.offline.ray.cluster import ray_session
            from app.offline.ray.extract import FrontEndSpec, RayJob
            spec = FrontEndSpec(frontend.name, args.vggish_weights, random_seed(args),
                                not getattr(args, "recompute_frontend", False))
            with ray_session(args.ray) as ray:
                extract_gtzan(folder, args.out, frontend, args.batch_size, folders=bool(args.folders),
                              ray=RayJob(spec, ray_workers(ray, args.workers)))
            return 0
    except (AudioError, RayClusterError) as e:
        return error(e)
    except KeyboardInterrupt as e:
        print(f"# stopped by {signal_name(e)}: finished tracks are kept; run the same command again "
              f"to resume", file=sys.stderr)
        return exit_code(e)


