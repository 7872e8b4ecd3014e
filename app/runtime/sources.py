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
            return DemoSource(realtime=self.realtime, seconds=self.seconds)
        if self.kind is SourceKind.MIC:
            mic = MicrophoneSource(self.arg or None)          # index or (partial) name
            return mic.start() if start else mic
        if not self.arg:
            raise AudioFileError("no file chosen: open a file (or drop one on the window) first")
        return FileSource(self.arg, realtime=self.realtime, loop=self.loop)


def audio_paths(paths) -> tuple[list[tuple[str, str]], int]:
    """Files and folders -> [(path, stream name)] in a stable order, and how many files of the
    folders were passed over (not audio by their suffix, or hidden). A file given by name is
    taken whatever its suffix and named 'file:NAME'; a folder is searched recursively (links to
    folders are not followed) and its files are named by their path inside it,
    'file:FOLDER/SUB/NAME'. A name given twice gets '#2', '#3', ..."""
    import os
    from pathlib import Path

    from audio.decoding import audio_files_under
    from audio.errors import printable
    found, skipped, seen = [], 0, {}

    def add(path: str, name: str) -> None:
        seen[name] = seen.get(name, 0) + 1
        found.append((path, name if seen[name] == 1 else f"{name}#{seen[name]}"))

    for given in map(str, paths):
        if not os.path.isdir(given):
            add(given, f"file:{printable(Path(given).name)}")
            continue
        top = Path(given).resolve().name or given
        files, passed_over = audio_files_under(given)
        skipped += passed_over
        for path in files:
            add(str(path), f"file:{printable(str(Path(top) / path.relative_to(given)))}")
    return found, skipped
