"""`python main.py classify`: one record per 0.25 s hop, per model, from a file, mic or demo;
several files (or ``--demo N``) run as concurrent streams of the engine (app/runtime/engine.py),
one source as its one stream."""
from __future__ import annotations

import sys

import torch

from app.runtime.frontend_args import add_frontend_arguments
from app.runtime.onnx_step import OnnxModelError
from audio.errors import AudioError
from audio.melspec import HOP_SECONDS
from models.checkpoint import CheckpointError
from models.sda import VARIANTS

from . import command
from .argtypes import POSITIVE, SECONDS, WINDOW, writable_file


def add_arguments(p) -> None:
    src = p.add_argument_group("source (one of)")
    src.add_argument("path", nargs="*", help="audio files (any format soundfile/librosa decodes); "
                                             "several run as concurrent streams of one engine")
    src.add_argument("--mic", action="store_true", help="capture from an input device")
    src.add_argument("--demo", nargs="?", const=1, type=POSITIVE, metavar="N",
                     help="the built-in synthetic music signal (N streams with seeds 0..N-1)")
    p.add_argument("--device", help="input device index or (partial) name, with --mic")
    p.add_argument("--list-devices", action="store_true", help="list input devices and exit")
    p.add_argument("--seconds", type=SECONDS, help="stop after this much audio (> 0)")
    p.add_argument("--realtime", action="store_true", help="pace a file/demo in real time")
    p.add_argument("--loop", action="store_true", help="loop a file")
    add_frontend_arguments(p, fallback=True, recompute=True)
    p.add_argument("--variant", nargs="+", choices=VARIANTS,
                   help="add untrained models of these variants (default: none when trained "
                        "models exist, else all)")
    p.add_argument("--checkpoint", nargs="+", default=[], metavar="FILE",
                   help="trained models (default: the shipped ones in assets/models/ for the "
                        "front end)")
    p.add_argument("--onnx", nargs="+", default=[], metavar="FILE",
                   help="exported streaming steps (python main.py export) run by ONNX Runtime, "
                        "named onnx:<variant> in the records, beside the other models")
    p.add_argument("--layers", type=int, choices=(1, 2), default=1, help="blocks of untrained models")
    p.add_argument("--window", type=WINDOW, default=None,
                   help="window n of untrained models in tokens (default 29 musicnn, 120 vggish)")
    p.add_argument("--landmarks", type=POSITIVE, default=4, help="Nyström landmarks m of untrained models")
    p.add_argument("--seed", type=int, default=0, help="seed of the (untrained) model weights")
    p.add_argument("--cuda", action="store_true", help="run the front end and models on CUDA if available")
    p.add_argument("--tf32", action="store_true",
                   help="with --cuda: musicnn's network in TF32 with cuDNN (its error: docs/front-ends.md)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--jsonl", action="store_true", help="JSON lines on stdout")
    out.add_argument("--csv", metavar="FILE", type=writable_file, help="write records to a CSV file")


def source_spec(args):
    from app.runtime.sources import SourceKind, SourceSpec
    chosen = [bool(args.path), args.mic, bool(args.demo)]
    if sum(chosen) != 1:
        raise SystemExit("classify: give exactly one source: PATH, --mic or --demo")
    if args.mic:
        return SourceSpec(SourceKind.MIC, args.device or "")
    if args.demo:
        return SourceSpec(SourceKind.DEMO, realtime=args.realtime, seconds=args.seconds)
    return SourceSpec(SourceKind.FILE, args.path[0], realtime=args.realtime, loop=args.loop)


def list_devices() -> int:
    from audio.sources import list_input_devices
    for d in list_input_devices():
        print(f"{d['index']:3d}  {d['name']}  ({d['hostapi']}, {d['channels']} ch, "
              f"{d['default_rate']:.0f} Hz)")
    return 0


def csv_progress(args, source, limit: int | None):
    """With --csv nothing else shows the run's progress: a bar (or on a pipe a line every tenth
    of the file, with the time left); the total is the file's hops, up to --seconds."""
    from app.offline.progress import Progress
    total = source.hops() if hasattr(source, "hops") and not getattr(source, "loop", False) else None
    if limit is not None:
        total = limit if total is None else min(total, limit)
    p = Progress(total if args.csv else 0, "classify", "hop", lambda line: print(line, file=sys.stderr))
    p.every = max(1, (total or 400) // 10)
    return p


@command("classify", "classify a file, the microphone or the demo signal", add_arguments)
def run(args) -> int:
    from app.runtime.csv_rows import CsvRows
    from app.runtime.engine import Engine
    from app.runtime.faults import exit_code, resource_message, signal_name, stdout_gone
    from app.runtime.frontend_args import frontend_from_args
    from app.runtime.lineup import default_lineup
    from app.runtime.records import csv_row, human
    from app.runtime.verdict import Tally

    if args.tf32 and not args.cuda:
        raise SystemExit("classify: --tf32 is for --cuda (the CPU has no TF32)")
    try:
        if args.list_devices:
            return list_devices()
        if len(args.path) > 1 or (args.demo or 0) > 1:
            return run_streams(args)
        device = "cuda" if args.cuda and torch.cuda.is_available() else "cpu"
        source = source_spec(args).open(start=False)        # a bad file or device fails before the models load
        try:
            frontend = frontend_from_args(args, device)
            entries = default_lineup(frontend, device, checkpoints=args.checkpoint, onnx=args.onnx,
                                     variants=args.variant, layers=args.layers, window=args.window,
                                     landmarks=args.landmarks, seed=args.seed)
        except BaseException:
            source.close()
            raise
        engine = Engine(frontend, entries, capacity=1)     # on CUDA each model step a replayed CUDA graph
        untrained = [e.name for e in entries if not e.trained]
        trained = [f"{e.name} ({e.path})" for e in entries if e.trained]
        print(f"# source {source.name}; front end: {frontend.description}"
              + (f"; trained: {', '.join(trained)}" if trained else "")
              + (f"; UNTRAINED models (random weights, seed {args.seed}), marked *: "
                 f"{', '.join(untrained)}" if untrained else ""), file=sys.stderr)
        rows, tally, code = CsvRows(args.csv) if args.csv else None, Tally(), 0
        limit = None if args.seconds is None else int(args.seconds / HOP_SECONDS)
        progress = csv_progress(args, source, limit)
        try:
            for r in engine.run([source], warm=True):
                tally.add(r)
                if args.jsonl:
                    print(r.to_json(), flush=True)
                elif rows is not None:
                    rows.write(csv_row(r))
                    progress.step(f"# {r.step + 1} steps written to {args.csv}"
                                  if (r.step + 1) % progress.every == 0 else "")
                else:
                    print(human(r), flush=True)
                if args.seconds is not None and r.audio_time >= args.seconds - 1e-9:
                    break                          # audio gone by, dropped hops included
        except KeyboardInterrupt as e:             # Ctrl+C, SIGTERM: a normal way to stop a live run
            print(f"# stopped by {signal_name(e)}", file=sys.stderr)
            code = exit_code(e)
        except BrokenPipeError:                    # `classify ... | head`: the reader is gone
            print("# stopped: the reader of the output closed it", file=sys.stderr)
            code = stdout_gone()
        except AudioError as e:                    # mid-stream: a device gone, a file changed
            print(f"error: {e}", file=sys.stderr)   # the summary and verdict of what ran follow
            code = 1
        except OSError as e:
            message = resource_message(e, args.csv)
            if message is None:
                raise
            print(f"error: {message}; the CSV keeps its {rows.rows if rows else 0} complete rows",
                  file=sys.stderr)
            code = 1
        finally:
            progress.close()
            source.close()
            if rows is not None:
                rows.close()
        for _, why in engine.errors:               # the stream left early (a model's non-finite answer)
            print(f"error: {why}", file=sys.stderr)
            code = 1
        stats = source.stats
        print(f"# {stats.hops} hops, {stats.dropped} dropped, {stats.overflows} input overflows, "
              f"{stats.nonfinite} non-finite samples zeroed, {stats.clipped} samples clipped"
              + (f"; {rows.rows} rows in {args.csv}" if rows is not None and rows.created
                 else f"; no rows, {args.csv} not written" if rows is not None else ""), file=sys.stderr)
        if tally.tops:
            print(f"# verdict over {source.name}, per model (the genre most often on top):\n"
                  + "\n".join(f"#   {line}" for line in tally.table().splitlines()), file=sys.stderr)
        return code
    except (AudioError, CheckpointError, OnnxModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def stream_sources(args) -> tuple[list, int]:
    """The sources of a many-stream run, and how many files could not be opened (each said in
    one line); names made unique (a file given twice is two streams)."""
    from audio.sources import DemoSource, FileSource
    if args.demo:
        sources = [DemoSource(seed=i, seconds=args.seconds) for i in range(args.demo)]
        for i, s in enumerate(sources):
            s.name = f"demo:{i}"
        return sources, 0
    sources, failed, seen = [], 0, {}
    for path in args.path:
        try:
            source = FileSource(path)
        except AudioError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        seen[source.name] = seen.get(source.name, 0) + 1
        if seen[source.name] > 1:
            source.name += f"#{seen[source.name]}"
        sources.append(source)
    return sources, failed


def run_streams(args) -> int:
    """Every file (or demo) as a stream of one engine: the models step once per hop for all of
    them; records carry their stream's ``source``; one verdict per stream."""
    from app.runtime.csv_rows import CsvRows
    from app.runtime.frontend_args import frontend_from_args
    from app.runtime.lineup import default_lineup
    from app.runtime.engine import Engine
    from app.runtime.records import csv_row, human
    from app.runtime.verdict import Tally

    if args.mic or args.realtime or args.loop:
        raise SystemExit("classify: several streams run from files or --demo N, as fast as they "
                         "decode (not --mic, --realtime, --loop)")
    sources, failed = stream_sources(args)
    if not sources:
        return 1
    device = "cuda" if args.cuda and torch.cuda.is_available() else "cpu"
    frontend = frontend_from_args(args, device)
    entries = default_lineup(frontend, device, checkpoints=args.checkpoint, onnx=args.onnx, variants=args.variant,
                             layers=args.layers, window=args.window, landmarks=args.landmarks, seed=args.seed)
    engine = Engine(frontend, entries, capacity=len(sources))
    engine.warm()
    print(f"# {len(sources)} streams in one engine; front end: {frontend.description}; models: "
          + ", ".join(e.name + ("" if e.trained else "*") for e in entries), file=sys.stderr)
    rows, tallies, said = CsvRows(args.csv) if args.csv else None, {s.name: Tally() for s in sources}, 0
    try:
        for r in engine.run(sources):
            tallies[r.source].add(r)
            if args.jsonl:
                print(r.to_json(), flush=True)
            elif rows is not None:
                rows.write(csv_row(r))
            else:
                print(f"{r.source}  {human(r)}", flush=True)
            for stream, why in engine.errors[said:]:
                print(f"error: {stream.name}: {why}", file=sys.stderr)
            said = len(engine.errors)
            if args.seconds is not None and r.audio_time >= args.seconds - 1e-9:
                stream = next(s for s in engine.streams if s.name == r.source)
                engine.leave(stream)
    finally:
        if rows is not None:
            rows.close()
    for stream, why in engine.errors[said:]:
        print(f"error: {stream.name}: {why}", file=sys.stderr)
    for source in sources:
        stats, tally = source.stats, tallies[source.name]
        print(f"# {source.name}: {stats.hops} hops, {stats.nonfinite} non-finite samples zeroed, "
              f"{stats.clipped} samples clipped", file=sys.stderr)
        if tally.tops:
            print(f"# verdict over {source.name}, per model:\n"
                  + "\n".join(f"#   {line}" for line in tally.table().splitlines()), file=sys.stderr)
    if rows is not None:
        print(f"# {rows.rows} rows in {args.csv}" if rows.created else f"# no rows, {args.csv} not written",
              file=sys.stderr)
    return 1 if failed or engine.errors else 0
