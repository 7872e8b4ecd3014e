"""`python main.py classify`: one record per 0.25 s step, per model, from a file, mic or demo."""
from __future__ import annotations

import csv
import json
import sys

import torch

from audio.errors import AudioError, VGGishWeightsError
from audio.frontends import FRONTENDS
from audio.gtzan import GENRES
from models.checkpoint import CheckpointError
from models.sda import VARIANTS


def add_arguments(p) -> None:
    src = p.add_argument_group("source (one of)")
    src.add_argument("path", nargs="?", help="audio file (any format soundfile/librosa decodes)")
    src.add_argument("--mic", action="store_true", help="capture from an input device")
    src.add_argument("--demo", action="store_true", help="the built-in synthetic music signal")
    p.add_argument("--device", help="input device index or (partial) name, with --mic")
    p.add_argument("--list-devices", action="store_true", help="list input devices and exit")
    p.add_argument("--seconds", type=float, help="stop after this much audio")
    p.add_argument("--realtime", action="store_true", help="pace a file/demo in real time")
    p.add_argument("--loop", action="store_true", help="loop a file")
    p.add_argument("--frontend", choices=FRONTENDS, default=None,
                   help="token front end: musicnn (default; its weights ship) or vggish (the "
                        "paper's; implied by --vggish-weights / --random-vggish)")
    p.add_argument("--variant", nargs="+", choices=VARIANTS,
                   help="add untrained models of these variants (default: none when trained "
                        "models exist, else all)")
    p.add_argument("--checkpoint", nargs="+", default=[], metavar="FILE",
                   help="trained models (default: the shipped ones in assets/models/ for the "
                        "front end)")
    p.add_argument("--layers", type=int, choices=(1, 2), default=1)
    p.add_argument("--window", type=int, default=None,
                   help="window n of untrained models in tokens (default 29 musicnn, 120 vggish)")
    p.add_argument("--landmarks", type=int, default=4, help="Nyström landmarks m")
    p.add_argument("--seed", type=int, default=0, help="seed of the (untrained) model weights")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--vggish-weights", help="VGGish state dict (default: env/hub cache/download)")
    w.add_argument("--random-vggish", nargs="?", type=int, const=0, metavar="SEED",
                   help="random VGGish weights (seeded), for tests and demos")
    p.add_argument("--fallback-random-vggish", action="store_true",
                   help="if no VGGish weights are found, say so and use random ones (default run)")
    p.add_argument("--recompute-frontend", action="store_true",
                   help="recompute musicnn's whole 3 s patch every hop (the reference) instead of "
                        "the continual front end")
    p.add_argument("--cuda", action="store_true", help="run the front end and models on CUDA if available")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--jsonl", action="store_true", help="JSON lines on stdout")
    out.add_argument("--csv", metavar="FILE", help="write records to a CSV file")


def make_source(args):
    from audio.sources import DemoSource, FileSource, MicrophoneSource

    chosen = [bool(args.path), args.mic, args.demo]
    if sum(chosen) != 1:
        raise SystemExit("classify: give exactly one source: PATH, --mic or --demo")
    if args.mic:
        return MicrophoneSource(args.device)
    if args.demo:
        return DemoSource(realtime=args.realtime, seconds=args.seconds)
    return FileSource(args.path, realtime=args.realtime, loop=args.loop)


def load_models(args, frontend, device) -> list:
    """Trained models (--checkpoint, else the shipped ones), untrained ones for --variant."""
    from app.lineup import default_lineup
    return default_lineup(frontend, device, checkpoints=args.checkpoint, variants=args.variant,
                          layers=args.layers, window=args.window, landmarks=args.landmarks,
                          seed=args.seed)


def csv_row(r) -> dict:
    row = {"step": r.step, "audio_time_s": r.audio_time, "source": r.source, "frontend": r.frontend,
           "frontend_ms": round(r.latency_ms["frontend"], 3), "frontend_flops": r.frontend_flops,
           "dropped_hops": r.dropped_hops}
    for name, probs in r.probabilities.items():
        row[f"{name}.top"] = r.top[name][0]
        row[f"{name}.untrained"] = r.untrained[name]
        for g, p in zip(GENRES, probs):
            row[f"{name}.p_{g}"] = p
        for k, v in r.flops[name].items():
            row[f"{name}.flops_{k}"] = v
        row[f"{name}.latency_ms"] = round(r.latency_ms[name], 3)
        row[f"{name}.state_bytes"] = r.state_bytes[name]
    return row


def human(r) -> str:
    cells = []
    for name, (genre, p) in r.top.items():
        mark = "*" if r.untrained[name] else ""
        cells.append(f"{name}{mark}: {genre} {p:.2f} ({r.flops[name]['sda'] / 1e3:.1f}k SDA FLOPs, "
                     f"{r.latency_ms[name]:.2f} ms)")
    return (f"[{r.step:4d}] {r.audio_time:7.2f}s  front end {r.latency_ms['frontend']:.1f} ms, "
            f"{r.frontend_flops / 1e6:.0f}M FLOPs | " + " | ".join(cells))


def final_verdict(counts: dict, last) -> str:
    """Per model: the genre of the last step and the genre most often on top over the run."""
    lines = []
    for name, c in counts.items():
        top, n = max(c.items(), key=lambda kv: kv[1])
        total = sum(c.values())
        lines.append(f"#   {name}: last {last.top[name][0]} ({last.top[name][1]:.2f}); most often "
                     f"{top} ({n}/{total} steps)")
    return "\n".join(lines)


def build_frontend_for(args, device):
    """The chosen front end; with --fallback-random-vggish a missing VGGish becomes random."""
    from audio.frontends import build_frontend, resolve_name
    args.frontend = resolve_name(args.frontend, args.vggish_weights, args.random_vggish)
    try:
        return build_frontend(args.frontend, device=device, vggish_weights=args.vggish_weights,
                              random_vggish=args.random_vggish,
                              continual=not getattr(args, "recompute_frontend", False))
    except VGGishWeightsError as e:
        if not getattr(args, "fallback_random_vggish", False):
            raise
        print(f"# {e}\n# continuing with RANDOM VGGish weights", file=sys.stderr)
        return build_frontend("vggish", device=device, random_vggish=0)


def run(args) -> int:
    from app.engine import Engine
    from audio.sources import list_input_devices

    try:
        if args.list_devices:
            for d in list_input_devices():
                print(f"{d['index']:3d}  {d['name']}  ({d['hostapi']}, {d['channels']} ch, "
                      f"{d['default_rate']:.0f} Hz)")
            return 0
        device = "cuda" if args.cuda and torch.cuda.is_available() else "cpu"
        source = make_source(args)                 # a bad file or device fails before the models load
        try:
            frontend = build_frontend_for(args, device)
            entries = load_models(args, frontend, device)
        except BaseException:
            source.close()
            raise
        engine = Engine(frontend, {e.name: e.model for e in entries},
                        {e.name: e.trained for e in entries},
                        spacing={e.name: e.spacing for e in entries},
                        frontends={e.name: e.frontend for e in entries if e.frontend})
        untrained = [e.name for e in entries if not e.trained]
        trained = [f"{e.name} ({e.path})" for e in entries if e.trained]
        print(f"# source {source.name}; front end: {frontend.description}"
              + (f"; trained: {', '.join(trained)}" if trained else "")
              + (f"; UNTRAINED models (random weights, seed {args.seed}), marked *: "
                 f"{', '.join(untrained)}" if untrained else ""), file=sys.stderr)
        writer, csv_file, last = None, None, None
        counts = {e.name: {} for e in entries}
        limit = None if args.seconds is None else int(args.seconds / 0.25)
        try:
            for r in engine.run(source):
                last = r
                for name, (genre, _) in r.top.items():
                    c = counts.setdefault(name, {})
                    c[genre] = c.get(genre, 0) + 1
                if args.jsonl:
                    print(json.dumps(r.to_dict()), flush=True)
                elif args.csv:
                    row = csv_row(r)
                    if writer is None:
                        csv_file = open(args.csv, "w", newline="")
                        writer = csv.DictWriter(csv_file, fieldnames=list(row))
                        writer.writeheader()
                    writer.writerow(row)
                else:
                    print(human(r), flush=True)
                if limit is not None and r.step + 1 >= limit:
                    break
        except KeyboardInterrupt:                  # Ctrl-C: a normal way to stop a live run
            print("# stopped", file=sys.stderr)
        finally:
            source.close()
            if csv_file is not None:
                csv_file.close()
        stats = source.stats
        print(f"# {stats.hops} hops, {stats.dropped} dropped, {stats.overflows} input overflows, "
              f"{stats.nonfinite} non-finite samples zeroed, {stats.clipped} samples clipped",
              file=sys.stderr)
        if last is not None and not args.jsonl:
            print("# verdict:\n" + final_verdict({k: v for k, v in counts.items() if v}, last),
                  file=sys.stderr)
        return 0
    except (AudioError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
