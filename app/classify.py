"""`python main.py classify`: one record per 0.25 s step, per model, from a file, mic or demo."""
from __future__ import annotations

import csv
import json
import sys

import torch

from audio.errors import AudioError, VGGishWeightsError
from audio.gtzan import GENRES
from models.checkpoint import CheckpointError
from models.sda import VARIANTS
from models.transformer import ModelConfig, build_model


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
    p.add_argument("--variant", nargs="+", choices=VARIANTS,
                   help="untrained models of these variants (default: all, unless checkpoints)")
    p.add_argument("--checkpoint", nargs="+", default=[], metavar="FILE",
                   help="trained models (one per checkpoint), run side by side")
    p.add_argument("--layers", type=int, choices=(1, 2), default=1)
    p.add_argument("--window", type=int, default=120, help="window n in tokens (0.25 s each)")
    p.add_argument("--landmarks", type=int, default=4, help="Nyström landmarks m")
    p.add_argument("--seed", type=int, default=0, help="seed of the (untrained) model weights")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--vggish-weights", help="VGGish state dict (default: env/hub cache/download)")
    w.add_argument("--random-vggish", nargs="?", type=int, const=0, metavar="SEED",
                   help="random VGGish weights (seeded), for tests and demos")
    p.add_argument("--fallback-random-vggish", action="store_true",
                   help="if no VGGish weights are found, say so and use random ones (default run)")
    p.add_argument("--cuda", action="store_true", help="run VGGish and models on CUDA if available")
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


def load_models(args, device) -> tuple[dict, dict]:
    """Trained models from --checkpoint files, untrained ones for --variant (default: all)."""
    from models.checkpoint import load_checkpoint

    models, trained = {}, {}
    for path in args.checkpoint:
        model, payload = load_checkpoint(path, in_dim=128, classes=list(GENRES), device=device)
        name = model.cfg.variant + ("/fixed" if model.cfg.landmark_mode == "fixed" else "")
        while name in models:
            name += "'"
        models[name], trained[name] = model, True
    variants = args.variant if args.variant is not None else ([] if args.checkpoint else list(VARIANTS))
    for v in variants:
        torch.manual_seed(args.seed)
        cfg = ModelConfig(variant=v, layers=args.layers, window=args.window,
                          num_landmarks=min(args.landmarks, args.window))
        name = v if v not in models else f"{v} (untrained)"
        models[name], trained[name] = build_model(cfg).to(device), False
    return models, trained


def csv_row(r) -> dict:
    row = {"step": r.step, "audio_time_s": r.audio_time, "source": r.source, "vggish": r.vggish,
           "frontend_ms": round(r.latency_ms["frontend"], 3), "vggish_ms": round(r.latency_ms["vggish"], 3),
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
    return (f"[{r.step:4d}] {r.audio_time:7.2f}s  front {r.latency_ms['frontend']:.1f} ms, "
            f"vggish {r.latency_ms['vggish']:.1f} ms | " + " | ".join(cells))


def run(args) -> int:
    from app.engine import Engine
    from audio.sources import list_input_devices
    from audio.vggish import build_embedder

    try:
        if args.list_devices:
            for d in list_input_devices():
                print(f"{d['index']:3d}  {d['name']}  ({d['hostapi']}, {d['channels']} ch, "
                      f"{d['default_rate']:.0f} Hz)")
            return 0
        device = "cuda" if args.cuda and torch.cuda.is_available() else "cpu"
        try:
            embedder = build_embedder(args.vggish_weights, random_seed=args.random_vggish, device=device)
        except VGGishWeightsError as e:
            if not args.fallback_random_vggish:
                raise
            print(f"# {e}\n# continuing with RANDOM VGGish weights", file=sys.stderr)
            embedder = build_embedder(random_seed=0, device=device)
        models, trained = load_models(args, device)
        source = make_source(args)
        engine = Engine(embedder, models, trained)
        untrained = [n for n in models if not trained[n]]
        print(f"# source {source.name}; {embedder.description}; "
              + (f"UNTRAINED models (random weights, seed {args.seed}), marked *: "
                 f"{', '.join(untrained)}" if untrained else "all models trained"), file=sys.stderr)
        writer, csv_file = None, None
        limit = None if args.seconds is None else int(args.seconds / 0.25)
        try:
            for r in engine.run(source):
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
        return 0
    except (AudioError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
