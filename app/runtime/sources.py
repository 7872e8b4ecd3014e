"""Which audio source to open, named once: the kind (demo, microphone, file) and its argument,
parsed from `demo`, `mic`, `mic:DEVICE` or `file:PATH` (the window's --source, saved settings)
or from classify's arguments, and opened by one factory."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from audio.errors import AudioFileError


class SourceKind(str, Enum):
    DEMO = "demo"
    MIC = "mic"
    FILE = "file"

    @property
    def label(self) -> str:
        return {"demo": "Demo signal", "mic": "Microphone", "file": "File"}[self.value]


@dataclass(frozen=True)
class SourceSpec:
    kind: SourceKind
    arg: str = ""              # the device (mic) or path (file); '' for the default device
    realtime: bool = True      # pace a file or the demo like a sound card
    speed: float = 1.0         # ... playing at this speed (audio.sources.SPEEDS)
    loop: bool = False         # loop a file
    seconds: float | None = None   # the demo's length (None: endless)

    @staticmethod
    def parse(text: str, **kw) -> "SourceSpec":
        """'demo' | 'mic' | 'mic:DEVICE' | 'file:PATH' -> a SourceSpec; ValueError otherwise."""
        kind, _, arg = text.partition(":")
        try:
            k = SourceKind(kind)
        except ValueError:
            raise ValueError(f"a source is demo, mic, mic:DEVICE or file:PATH, got {text!r}") from None
        if k is SourceKind.DEMO and arg:
            raise ValueError(f"the demo source takes no argument, got {text!r}")
        if k is SourceKind.FILE and not arg:
            raise ValueError("file: needs a path, e.g. file:song.wav")
        return SourceSpec(k, arg, **kw)

    def __str__(self) -> str:
        return self.kind.value + (f":{self.arg}" if self.arg else "")

    def open(self, start: bool = True):
        """The opened source (a microphone is started unless ``start`` is False; iterating it
        starts it then). Typed AudioError on failure."""
        from audio.sources import DemoSource, FileSource, MicrophoneSource
        if self.kind is SourceKind.DEMO:
            return DemoSource(realtime=self.realtime, seconds=self.seconds, speed=self.speed)
        if self.kind is SourceKind.MIC:
            mic = MicrophoneSource(self.arg or None)          # index or (partial) name
            return mic.start() if start else mic
        if not self.arg:
            raise AudioFileError("no file chosen: open a file (or drop one on the window) first")
        return FileSource(self.arg, realtime=self.realtime, loop=self.loop, speed=self.speed)


STDIN = "-"                     # a path that means standard input
MAX_STDIN_BYTES = 4 * 2**30     # what `classify -` copies from a pipe at most


def spool_stdin(read=None, folder=None) -> str:
    """Standard input copied to a temporary file (formats need to seek; nothing is held in
    memory), 1 MB at a time; the caller removes it. AudioFileError for nothing at all, or more
    than MAX_STDIN_BYTES; OSError (a full disk) as it comes."""
    import os
    import sys
    import tempfile
    read = read or sys.stdin.buffer.read
    fd, path = tempfile.mkstemp(prefix="nystream-stdin-", dir=folder)
    total = 0
    try:
        with os.fdopen(fd, "wb") as f:
            while chunk := read(1 << 20):
                total += len(chunk)
                if total > MAX_STDIN_BYTES:
                    raise AudioFileError(f"standard input is over {MAX_STDIN_BYTES >> 30} GB, the most read "
                                         "from a pipe; give the file's path instead")
                f.write(chunk)
        if total == 0:
            raise AudioFileError("standard input is empty (0 bytes): pipe audio into `classify -`")
    except BaseException:
        os.unlink(path)
        raise
    return path


def audio_paths(paths) -> tuple[list[tuple[str, str]], int]:
    """Files and folders -> [(path, stream name)] in a stable order, and how many files of the
    folders were passed over (not audio by their suffix, or hidden). A file given by name is
    taken whatever its suffix and named 'file:NAME'; a folder is searched recursively (links to
    folders are not followed) and its files are named by their path inside it,
    'file:FOLDER/SUB/NAME'; ``-`` (standard input, the caller spools it) is 'stdin'. A name given
    twice gets '#2', '#3', ..."""
    import os
    from pathlib import Path

    from audio.decoding import audio_files_under
    from audio.errors import printable
    found, skipped, seen = [], 0, {}

    def add(path: str, name: str) -> None:
        seen[name] = seen.get(name, 0) + 1
        found.append((path, name if seen[name] == 1 else f"{name}#{seen[name]}"))

    for given in map(str, paths):
        if given == STDIN:
            add(given, "stdin")
            continue
        if not os.path.isdir(given):
            add(given, f"file:{printable(Path(given).name)}")
            continue
        top = Path(given).resolve().name or given
        files, passed_over = audio_files_under(given)
        skipped += passed_over
        for path in files:
            add(str(path), f"file:{printable(str(Path(top) / path.relative_to(given)))}")
    return found, skipped


class RunSources:
    """A run's sources (``classify``'s), opened one at a time as the engine takes them: a file
    that cannot be opened is said to ``on_failure(path, name, error)`` and the next one is opened
    instead. ``-`` among ``paths`` is standard input, spooled to a file that ``close`` removes."""

    def __init__(self, paths, *, mic=False, input_device=None, demo=None, seconds=None, loop=False,
                 live=False):
        self.mic, self.input_device, self.demo, self.seconds, self.loop = mic, input_device, demo, seconds, loop
        self.failed, self.skipped, self.live = 0, 0, live
        self.paths: list[tuple[str, str]] = []
        self.spooled = spool_stdin() if STDIN in paths else None
        if paths:
            self.paths, self.skipped = audio_paths(paths)
        self.count = len(self.paths) if paths else (demo or 1)
        self.on_failure = None

    def __iter__(self):
        from audio.errors import AudioError
        from audio.sources import DemoSource, FileSource, MicrophoneSource
        if self.mic:
            yield MicrophoneSource(self.input_device or None)
            return
        if self.demo:
            for i in range(self.demo):
                source = DemoSource(seed=i, realtime=self.live, seconds=self.seconds)
                source.name = "demo" if self.demo == 1 else f"demo:{i}"
                yield source
            return
        for path, name in self.paths:
            try:
                source = FileSource(self.spooled if path == STDIN else path, realtime=self.live, loop=self.loop)
            except AudioError as e:
                self.failed += 1
                if self.on_failure is not None:
                    self.on_failure(path, name, str(e))
                continue
            source.name, source.path = name, path
            yield source

    def close(self) -> None:
        """The spooled standard input removed."""
        import os
        if self.spooled is not None:
            os.unlink(self.spooled)
            self.spooled = None
