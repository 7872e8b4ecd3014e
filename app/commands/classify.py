"""`nystream classify`: one record per 0.25 s hop, per model, from files, folders, the microphone
or the demo signal. Every source is a stream of one engine (app/runtime/engine.py); files run at
most ``--streams`` at a time, a new file joining as another ends, and each stream ends with its
verdict (a ``{"verdict": ...}`` record with --jsonl, a table on stderr, rows of --summary)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from itertools import islice

from models.variants import VARIANTS

from app.runtime.frontend_args import device_text
from app.runtime.verdict import TOP

from . import command, error
from .argtypes import (POSITIVE, SECONDS, WINDOW, add_device_arguments, add_old_pace_names, compute_device,
                       number, writable_dir, writable_file, writable_file_or_stdout)

STREAMS = {"cpu": 16, "cuda": 64}          # default --streams: files classified at once


def add_arguments(p) -> None:
    from app.runtime.frontend_args import add_frontend_arguments
    src = p.add_argument_group("source (one of)")
    src.add_argument("path", nargs="*", help="audio files or folders (searched recursively for audio files); "
                                             "each file is a stream of one engine; - reads a file from "
                                             "standard input")
    src.add_argument("--mic", action="store_true", help="capture from an input device")
    src.add_argument("--demo", nargs="?", const=1, type=POSITIVE, metavar="N",
                     help="the built-in synthetic music signal (N streams with seeds 0..N-1)")
    p.add_argument("--input-device", metavar="DEVICE", help="input device index or (partial) name, with --mic")
    p.add_argument("--list-devices", action="store_true", help="list input devices and exit")
    p.add_argument("--seconds", type=SECONDS, help="stop each stream after this much audio (> 0)")
    p.add_argument("--pace", choices=("fast", "realtime"), default="fast",
                   help="a file or the demo as fast as it decodes, or paced like a sound card (one source)")
    add_old_pace_names(p)
    p.add_argument("--loop", action="store_true", help="loop a file")
    p.add_argument("--streams", type=POSITIVE, metavar="N",
                   help=f"files classified at once (default: {STREAMS['cpu']} on the CPU, {STREAMS['cuda']} on CUDA)")
    add_frontend_arguments(p, fallback=True, recompute=True)
    p.add_argument("--variant", action="append", choices=VARIANTS, metavar="VARIANT",
                   help=f"add an untrained model of VARIANT ({', '.join(VARIANTS)}); repeat for more "
                        "(default: none when trained models exist, else all)")
    p.add_argument("--models", type=model_names, default="best", metavar="NAMES",
                   help="which shipped models run: 'all', or names separated by commas (regular, continual, "
                        "nystrom, continual_nystrom, continual_nystrom/fixed); default: the most accurate "
                        "(highest test accuracy, the cheaper step on a tie: continual)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="FILE",
                   help="run this trained model instead of the shipped ones; repeat for more")
    p.add_argument("--onnx", action="append", default=[], metavar="FILE",
                   help="an exported streaming step (nystream export) run by ONNX Runtime beside the other "
                        "models, named onnx:<variant>; repeat for more")
    p.add_argument("--layers", type=int, choices=(1, 2), default=1, help="blocks of untrained models")
    p.add_argument("--window", type=WINDOW, default=None,
                   help="window n of untrained models in tokens (default 29 musicnn, 120 vggish)")
    p.add_argument("--landmarks", type=POSITIVE, default=4, help="Nyström landmarks m of untrained models")
    p.add_argument("--seed", type=int, default=0, help="seed of the (untrained) model weights")
    add_device_arguments(p)
    p.add_argument("--smooth", type=number(lo=0), default=0.0, metavar="SECONDS",
                   help="also give each model's smoothed top genre (the window's reading: probabilities "
                        "averaged with this time constant; the window uses 5); 0: off")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--jsonl", action="store_true",
                     help="JSON lines on stdout: a record per hop, then a verdict record per stream")
    out.add_argument("--csv", metavar="FILE", type=writable_file_or_stdout,
                     help="write records to a CSV file (-: standard output)")
    p.add_argument("--output-dir", metavar="DIR", type=writable_dir,
                   help="also write one JSON file per input, DIR/NAME.json (NAME: the stream's name, a "
                        "folder's files under their folder): its verdict record, and with --output-records "
                        "its hop records")
    p.add_argument("--output-records", action="store_true", help="with --output-dir: the hop records too")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only each stream's verdict (one line per model) and errors")
    p.add_argument("--top", type=POSITIVE, default=TOP, metavar="K",
                   help=f"classes each verdict lists with their mean probability (default {TOP})")
    p.add_argument("--summary", metavar="FILE", type=writable_file,
                   help="write one CSV row per file and model: file, source, model, genre, share, confidence, "
                        "hops, error")


def model_names(text: str):
    """'all', 'best', or shipped models' names separated by commas."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give 'all' or model names separated by commas")
    return names[0] if len(names) == 1 and names[0] in ("all", "best") else names


def list_devices() -> int:
    from audio.sources import list_input_devices
    for d in list_input_devices():
        print(f"{d['index']:3d}  {d['name']}  ({d['hostapi']}, {d['channels']} ch, "
              f"{d['default_rate']:.0f} Hz)")
    return 0


def check_sources(args) -> None:
    chosen = [bool(args.path), args.mic, bool(args.demo)]
    if sum(chosen) != 1:
        raise SystemExit("classify: give exactly one kind of source: PATH..., --mic or --demo [N]")
    many = (args.demo or 0) > 1 or len(args.path) > 1 or any(os.path.isdir(p) for p in args.path)
    if many and (args.pace == "realtime" or args.loop):
        raise SystemExit("classify: several streams run as fast as their files decode (not --pace realtime, --loop)")
    if args.mic and args.loop:
        raise SystemExit("classify: --loop is for a file")
    if args.input_device is not None and not args.mic:
        raise SystemExit("classify: --input-device is for --mic")
    if args.path.count("-") > 1:
        raise SystemExit("classify: standard input (-) can be read once")
    if args.output_records and not args.output_dir:
        raise SystemExit("classify: --output-records is for --output-dir")
    if args.checkpoint and args.models != "best":
        raise SystemExit("classify: --models chooses among the shipped models; --checkpoint replaces them")


class Report:
    """What the run writes besides its records: per stream, when it ends, its counts, its
    verdict (a JSON record with --jsonl, a table on stderr, lines on stdout with --quiet), its
    --summary rows and its --output-dir file; progress over the files with the time left."""

    def __init__(self, args, sources):
        from app.offline.progress import Progress
        from app.runtime.csv_rows import CsvRows
        self.args, self.sources = args, sources
        self.summary = CsvRows(args.summary) if args.summary else None
        self.tallies: dict[str, object] = {}         # the streams still running: name -> Tally
        self.smoothers: dict[str, object] = {}
        self.records: dict[str, list] = {}           # --output-records: name -> its hop records
        many = sources.count > 1
        self.progress = Progress(sources.count if many and not sources.live and not args.quiet else 0,
                                 "classify", "file", lambda line: print(line, file=sys.stderr))
        self.progress.every = max(1, sources.count // 10)
        self.ended = 0
        self.reported: set[str] = set()              # the streams whose end was said

    def say(self, text: str) -> None:
        """A line on stderr (with --quiet only errors)."""
        if not (self.args.quiet and text.startswith("#")):
            self.progress.say(text)

    def record(self, r) -> None:
        from app.runtime.verdict import Smoother, Tally, top_k
        tally = self.tallies.get(r.source)
        if tally is None:
            tally = self.tallies[r.source] = Tally()
            self.smoothers[r.source] = Smoother(self.args.smooth)
        tally.add(r)
        if self.args.output_records:
            self.records.setdefault(r.source, []).append(r.to_dict())
        if self.args.smooth > 0:
            smoother = self.smoothers[r.source]
            for name, m in r.models.items():
                m.smoothed_top = top_k(m.classes, smoother.update(name, m.probabilities), 1)[0]

    def failed(self, path: str, name: str, error: str) -> None:
        """A file that could not be opened: its line and summary row, and one step of progress."""
        from audio.errors import printable
        self.say(f"error: {error}")
        message = {"verdict": {}, "source": name, "path": printable(path), "hops": 0, "error": error}
        self._write_summary(printable(path), message)
        self._write_output(name, message)
        self._ended()

    def left(self, name: str, source, error: str | None = None) -> None:
        """A stream that ended (its source done, stopped, or failed): its counts and verdict."""
        from app.runtime.verdict import Tally, verdict_message
        from audio.errors import printable
        self.reported.add(name)
        tally = self.tallies.pop(name, None) or Tally()
        self.smoothers.pop(name, None)
        stats = source.stats
        message = verdict_message(tally, source, error, self.args.top)
        if hasattr(source, "path"):
            message["path"] = printable(source.path)
        if error is not None:
            self.say(f"error: {name}: {error}")
        self.say(f"# {name}: {stats.hops} hops, {stats.dropped} dropped, {stats.overflows} input "
                 f"overflows, {stats.nonfinite} non-finite samples zeroed, {stats.clipped} samples clipped")
        if tally.tops:
            self.say(f"# verdict over {name}, per model (the genre most often on top):\n"
                     + "\n".join(f"#   {line}" for line in tally.table(self.args.top).splitlines()))
        if self.args.jsonl:
            import json
            print(json.dumps(message, allow_nan=False), flush=True)
        elif self.args.quiet:
            for model, v in message["verdict"].items():
                top = ", ".join(f"{printable(c)} {100 * p:.0f}%" for c, p in v["top"])
                print(f"{printable(name)}  {printable(model)}  {printable(v['genre'])}  ({100 * v['share']:.0f}% of "
                      f"{v['steps']} steps; highest mean probabilities: {top})", flush=True,
                      file=sys.stderr if self.args.csv == "-" else sys.stdout)     # stdout: the CSV's
        self._write_summary(printable(getattr(source, "path", name)), message)
        self._write_output(name, message, self.records.pop(name, None))
        self._ended()

    def _write_output(self, name: str, message: dict, records=None) -> None:
        """--output-dir: DIR/NAME.json, NAME the stream's name without 'file:' (a folder's files
        under their folder), written whole (a temporary file renamed)."""
        if not self.args.output_dir:
            return
        from audio.files import atomic_write_json
        parts = [p for p in Path(name.removeprefix("file:")).parts if p not in ("", ".", "..", "/")]
        path = Path(self.args.output_dir).joinpath(*parts[:-1], (parts[-1] if parts else "stream") + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {**message, **({"records": records} if records is not None else {})})

    def _write_summary(self, file: str, message: dict) -> None:
        from app.runtime.verdict import summary_rows
        if self.summary is not None:
            for row in summary_rows(file, message):
                self.summary.write(row)

    def _ended(self) -> None:
        self.ended += 1
        every = self.progress.every
        self.progress.step(f"# {self.ended} of {self.sources.count} files done"
                           if self.ended % every == 0 or self.ended == self.sources.count else "")

    def close(self) -> None:
        self.progress.close()
        if self.summary is not None:
            self.summary.close()
            self.say(f"# {self.summary.rows} rows in {self.args.summary}" if self.summary.created
                     else f"# no rows, {self.args.summary} not written")


@command("classify", add_arguments)
def run(args) -> int:
    from app.runtime.lineup import UnknownModelError
    from app.runtime.onnx_step import OnnxModelError
    from audio.errors import AudioError
    from app.checkpoint import CheckpointError
    try:
        if args.list_devices:
            return list_devices()
        check_sources(args)
        device = compute_device(args, "classify")
        return classify(args, device)
    except UnknownModelError as e:
        return error(f"--models: {e}")
    except (AudioError, CheckpointError, OnnxModelError) as e:
        return error(e)


def classify(args, device: str) -> int:
    from app.runtime.sources import RunSources
    sources = RunSources(args.path, mic=args.mic, input_device=args.input_device, demo=args.demo,
                         seconds=args.seconds, loop=args.loop, live=args.mic or args.pace == "realtime")
    try:
        return classify_sources(args, device, sources)
    finally:
        sources.close()


def classify_sources(args, device: str, sources) -> int:
    from app.runtime.csv_rows import CsvRows
    from app.runtime.engine import Engine
    from app.runtime.faults import exit_code, raise_if_stopped, resource_message, signal_name, stdout_gone
    from app.runtime.frontend_args import frontend_from_args
    from app.runtime.lineup import default_lineup
    from app.runtime.records import csv_row, human
    from audio.errors import AudioError

    def note(text: str) -> None:                 # a '#' line on stderr, not with --quiet
        if not args.quiet:
            print(text, file=sys.stderr)
    if args.path and not sources.paths:
        raise SystemExit(f"classify: no audio files in {', '.join(args.path)} ({sources.skipped} other files)")
    opened = iter(sources)
    report = Report(args, sources)
    sources.on_failure = report.failed
    capacity = min(sources.count, args.streams or STREAMS[device])
    first = []
    try:
        first = list(islice(opened, capacity))      # a bad file or device fails before the models load
        if not first:                            # nothing could be opened: each said in one line
            report.close()
            return 1
        frontend = frontend_from_args(args, device)
        entries = default_lineup(frontend, device, checkpoints=args.checkpoint, onnx=args.onnx,
                                 variants=args.variant, layers=args.layers, window=args.window,
                                 landmarks=args.landmarks, seed=args.seed, models=args.models)
        engine = Engine(frontend, entries, capacity=capacity)   # on CUDA each model step a replayed CUDA graph
    except BaseException:
        for source in first:
            source.close()
        report.close()
        raise
    untrained = [e.name for e in entries if not e.trained]
    trained = [f"{e.name} ({e.path})" for e in entries if e.trained]
    what = (f"{sources.count} files, {capacity} at a time" if args.path and sources.count > 1
            else f"{args.demo} streams" if (args.demo or 0) > 1 else first[0].name)
    note(f"# {device_text(device, args.precision)}; source {what}; front end: {frontend.description}"
          + (f"; trained: {', '.join(trained)}" if trained else "")
          + (" (the most accurate shipped model; --models all runs them all)"
             if args.models == "best" and not args.checkpoint and trained else "")
          + (f"; UNTRAINED models (random weights, seed {args.seed}), marked *: "
             f"{', '.join(untrained)}" if untrained else ""))
    if sources.skipped:
        note(f"# {sources.skipped} files in the folders passed over (hidden, or not audio by their suffix)")
    many = sources.count > 1
    rows, code = CsvRows(args.csv) if args.csv else None, 0
    hop_progress = None
    if not many and args.csv and not args.quiet:     # one source to a CSV: nothing else shows progress
        hop_progress = hops_progress(args, first[0])
    engine.on_leave = lambda stream: report.left(stream.name, stream.source, stream.error)
    try:
        for r in engine.run(first, more=opened, warm=True):
            raise_if_stopped()                 # a stop that code under the engine swallowed
            report.record(r)
            if args.jsonl:
                if not args.quiet:
                    print(r.to_json(), flush=True)
            elif rows is not None:
                rows.write(csv_row(r))
                if hop_progress is not None:
                    hop_progress.step(f"# {r.step + 1} steps written to {args.csv}"
                                      if (r.step + 1) % hop_progress.every == 0 else "")
            elif not args.quiet:
                print(f"{r.source}  {human(r)}" if many else human(r), flush=True)
            if args.seconds is not None and r.audio_time >= args.seconds - 1e-9:
                stream = next(s for s in engine.streams if s.name == r.source)
                engine.leave(stream)           # audio gone by, dropped hops included
    except KeyboardInterrupt as e:             # Ctrl+C, SIGTERM: a normal way to stop a live run
        print(f"# stopped by {signal_name(e)}", file=sys.stderr)
        code = exit_code(e)
    except BrokenPipeError:                    # `classify ... | head`: the reader is gone
        print("# stopped: the reader of the output closed it", file=sys.stderr)
        code = stdout_gone()
    except AudioError as e:                    # mid-stream, outside a stream: a device gone
        code = error(e)
    except OSError as e:
        message = resource_message(e, args.csv or args.summary or args.output_dir)
        if message is None:
            raise
        print(f"error: {message}" + (f"; the CSV keeps its {rows.rows} complete rows" if rows else ""),
              file=sys.stderr)
        code = 1
    finally:
        if hop_progress is not None:
            hop_progress.close()
        for stream in list(engine.streams):    # stopped early: the verdicts of what ran follow
            try:
                engine.leave(stream)
            except BrokenPipeError:
                code = stdout_gone()
        for source in first:                   # stopped before they joined (in the warm-up)
            if source.name not in report.reported:
                source.close()
                try:
                    report.left(source.name, source)
                except BrokenPipeError:
                    code = stdout_gone()
        opened.close()                         # files not yet opened stay closed
        if rows is not None:
            rows.close()
        report.close()
    if rows is not None:
        where = "standard output" if args.csv == "-" else args.csv
        note(f"# {rows.rows} rows in {where}" if rows.created else f"# no rows, {where} not written")
    push = frontend.push_status()                         # one stream's compiled musicnn push (CPU)
    if push is not None:
        note(f"# the musicnn push: {push}")
    if engine.kernels is not None and engine.kernels.words() and engine.kernels.status != "compiled":
        note(f"# the models' steady steps: {engine.kernels.words()}")   # not (yet) compiled
    if sources.failed or engine.errors:
        code = code or 1
    return code


def hops_progress(args, source):
    """One file to a CSV: a bar (or on a pipe a line every tenth of the file, with the time left);
    the total is the file's hops, up to --seconds."""
    from app.offline.progress import Progress
    from audio.melspec import HOP_SECONDS
    total = source.hops() if hasattr(source, "hops") and not getattr(source, "loop", False) else None
    if args.seconds is not None:
        limit = int(args.seconds / HOP_SECONDS)
        total = limit if total is None else min(total, limit)
    p = Progress(total, "classify", "hop", lambda line: print(line, file=sys.stderr))
    p.every = max(1, (total or 400) // 10)
    return p
