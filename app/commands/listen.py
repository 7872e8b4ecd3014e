"""`python main.py listen ws://HOST:PORT/v1/stream (FILE | --demo | --mic)`: stream audio to a
`serve` server and print what `classify` prints (docs/serve.md)."""
from __future__ import annotations

from . import command, error
from .argtypes import SECONDS, OldMicrophoneDevice, add_old_pace_names, writable_file


def add_arguments(p) -> None:
    p.add_argument("url", help="the server's stream address, ws://HOST:PORT/v1/stream")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("path", nargs="?", help="an audio file")
    src.add_argument("--mic", action="store_true", help="capture from an input device")
    src.add_argument("--demo", action="store_true", help="the built-in synthetic music signal")
    p.add_argument("--input-device", metavar="DEVICE", help="input device index or (partial) name, with --mic")
    p.add_argument("--seconds", type=SECONDS, help="with --demo: stop after this much audio")
    add_old_pace_names(p)
    p.add_argument("--device", action=OldMicrophoneDevice)
    p.add_argument("--pace", choices=("realtime", "fast"), default="realtime",
                   help="send a file or the demo paced like a sound card, or as fast as the server's credit allows")
    p.add_argument("--token-file", metavar="FILE", help="send 'Authorization: Bearer' + the token in FILE")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--jsonl", action="store_true",
                     help="JSON lines on stdout: a record per hop, then the server's verdict record")
    out.add_argument("--csv", metavar="FILE", type=writable_file, help="write records to a CSV file")


@command("listen", add_arguments)
def run(args) -> int:
    from app.runtime.csv_rows import CsvRows
    from app.serve.client import ListenError, Printer, listen
    from app.serve.server import ServeError, read_token
    from audio.errors import AudioError
    from audio.sources import DemoSource, FileSource, MicrophoneSource
    if args.seconds is not None and not args.demo:
        raise SystemExit("listen: --seconds is for --demo (a file ends by itself; stop the microphone with Ctrl+C)")
    if not args.url.startswith(("ws://", "wss://")):
        raise SystemExit(f"listen: the address must start with ws:// or wss://, got {args.url!r}")
    try:
        token = read_token(args.token_file) if args.token_file else None
    except ServeError as e:
        raise SystemExit(f"listen: {e}") from None
    try:
        if args.mic:
            source = MicrophoneSource(args.input_device).start()
        elif args.demo:
            source = DemoSource(realtime=args.pace == "realtime", seconds=args.seconds)
        else:
            source = FileSource(args.path, realtime=args.pace == "realtime")
    except AudioError as e:
        return error(e)
    rows = CsvRows(args.csv) if args.csv else None
    try:
        return listen(args.url, source, token, Printer(args.jsonl, rows))
    except ListenError as e:
        return error(e)
    except AudioError as e:
        return error(e)
    finally:
        source.close()
        if rows is not None:
            rows.close()
