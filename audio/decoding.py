"""Audio files -> 16 kHz mono float32, streamed: a file is read block by block and resampled by
one stateful soxr stream, so memory does not grow with the file's length and a consumer that
stops early stops the reading. The stream is bit-identical to resampling the whole file at once
(tests/audio/test_decoding.py). Two readers: soundfile (libsndfile: WAV, FLAC, OGG/Vorbis/Opus,
MP3, AIFF, AU, ...; exact frame counts), and for what it cannot read PyAV (FFmpeg's decoders,
shipped in its wheels: AAC/M4A, Opus in WebM/MP4, WMA, ALAC, the audio track of a video, ...;
frame counts from the container's duration, an estimate), decoded packet by packet.

A file that changes under us ends the run with one AudioFileError, never a decode with the old
file's rate or length: each opening is checked against what ``probe`` saw (the file's identity,
size, modification time, rate, channels, frames), and each block against the file's size and
modification time. A file replaced by a rename while it is read is read to its end as it was (its
old contents stay open); the next opening (a loop's next pass) sees the change.

Input is made safe the same way as every source's (``condition``): channels averaged to mono,
NaN/Inf replaced by 0 (counted), samples beyond +-1 clipped (counted).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr

from .errors import AudioFileError
from .melspec import SAMPLE_RATE

BLOCK_SECONDS = 2.0         # read this much of the file at a time
BLOCK_SAMPLES = 1 << 22     # and at most this many samples (all channels) a block
MIN_RATE, MAX_RATE = 1_000, 768_000      # Hz a header may claim
MAX_CHANNELS = 64
MAX_SECONDS = 24 * 3600     # a file streamed hop by hop (classify, the window): its length costs no memory
MAX_WHOLE_SECONDS = 3600    # a file held whole (offline tokens, accuracy)
# what a folder's files must end with to be taken as audio: soundfile's formats and the
# containers PyAV reads audio from
AUDIO_SUFFIXES = frozenset(".wav .wave .flac .ogg .oga .opus .mp3 .aif .aiff .aifc .au .snd .caf .w64 .rf64 "
                           ".m4a .m4b .aac .mp4 .mov .m4v .mkv .mka .webm .wma .wmv .alac .ac3 .amr .3gp".split())


def is_audio_name(name: str) -> bool:
    """Whether a file found in a folder is taken as audio: an audio suffix, and not hidden (a
    macOS '._song.wav' is not a song)."""
    return not name.startswith(".") and Path(name).suffix.lower() in AUDIO_SUFFIXES


def audio_files_under(folder: str | Path) -> tuple[list[Path], int]:
    """The audio files under ``folder`` (``is_audio_name``), sorted, and how many other files
    were passed over; hidden folders are not entered, links to folders not followed."""
    found, skipped = [], 0
    for where, subfolders, files in os.walk(folder):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        for f in files:
            if is_audio_name(f):
                found.append(Path(where) / f)
            else:
                skipped += 1
    return sorted(found), skipped


@dataclass
class SourceStats:
    hops: int = 0          # hops delivered
    dropped: int = 0       # hops dropped because the consumer fell behind
    overflows: int = 0     # input overflows reported by the device
    nonfinite: int = 0     # NaN/Inf samples replaced by 0
    clipped: int = 0       # samples clipped to [-1, 1]


def condition(x: np.ndarray, stats: SourceStats) -> np.ndarray:
    """(frames,) or (frames, channels) -> mono float32, finite, within [-1, 1] (counted)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 2:
        x = x.mean(axis=1, dtype=np.float32) if x.shape[1] > 1 else x[:, 0]
    bad = ~np.isfinite(x)
    if bad.any():
        stats.nonfinite += int(bad.sum())
        x = np.where(bad, np.float32(0), x)
    over = np.abs(x) > 1.0
    if over.any():
        stats.clipped += int(over.sum())
        x = np.clip(x, -1.0, 1.0)
    return np.ascontiguousarray(x, dtype=np.float32)


@dataclass
class AudioFile:
    """A checked audio file: what ``probe`` found out reading its header (and, for PyAV, its
    first packet)."""
    path: Path
    input_rate: int
    channels: int
    frames: int                          # at input_rate (PyAV: from the container's duration)
    reader: str = "soundfile"            # or "av"
    stamp: tuple = ()                    # (device, inode, size, mtime_ns) when probed
    max_seconds: float = MAX_SECONDS     # the most read (PyAV: checked as it decodes)

    @property
    def exact(self) -> bool:
        """Whether ``frames`` is the file's exact length (soundfile), not an estimate."""
        return self.reader == "soundfile"

    @property
    def samples(self) -> int:
        """Samples at 16 kHz (the resampler's output length)."""
        return round(self.frames * SAMPLE_RATE / self.input_rate)

    def info(self) -> dict:
        return {"path": str(self.path), "input_rate": self.input_rate, "channels": self.channels,
                "duration_s": self.frames / self.input_rate}


def reason(e: BaseException) -> str:
    """An exception in a few words: its message on one line, or its type when it has none."""
    text = " ".join(str(e).split())
    return text or type(e).__name__


def probe(path: str | Path, max_seconds: float = MAX_SECONDS) -> AudioFile:
    """Check that ``path`` is a readable, non-empty audio file whose header claims at most
    ``max_seconds`` (MAX_WHOLE_SECONDS for a file held whole); AudioFileError says why not."""
    import soundfile as sf

    path = Path(path)
    try:
        if not path.exists():
            raise AudioFileError(f"audio file not found: {path}")
        if not path.is_file():
            raise AudioFileError(f"not a file: {path}")
        with open(path, "rb"):
            st = path.stat()
        size = st.st_size
    except PermissionError as e:           # the file, or a folder on its path
        raise AudioFileError(f"{path} cannot be read: permission denied") from e
    except OSError as e:
        raise AudioFileError(f"{path} cannot be read: {reason(e)}") from e
    if size == 0:
        raise AudioFileError(f"{path} is empty (0 bytes)")
    try:
        with sf.SoundFile(os.fsencode(path)) as f:     # bytes: a name need not be UTF-8
            found = AudioFile(path, int(f.samplerate), int(f.channels), int(f.frames))
    except Exception as sf_error:  # noqa: BLE001 - soundfile raises several types
        found = _probe_with_av(path, sf_error, max_seconds)
    found.stamp, found.max_seconds = stamp(st), max_seconds
    if found.frames == 0 and found.exact:
        raise AudioFileError(f"{path} contains no audio samples")
    check_claims(path, found.input_rate, found.channels, found.frames, max_seconds)
    return found


def check_claims(path, rate: int, channels: int, frames: int, max_seconds: float) -> None:
    """What a header claims, within what any real recording has; AudioFileError otherwise (a
    crafted header would otherwise size buffers of gigabytes)."""
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioFileError(f"{path} declares a sample rate of {rate:,} Hz; audio here is "
                             f"{MIN_RATE:,}..{MAX_RATE:,} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioFileError(f"{path} declares {channels:,} channels; at most {MAX_CHANNELS} are read")
    if frames > max_seconds * rate:
        raise AudioFileError(f"{path} declares {frames / rate / 3600:,.1f} hours of audio, over the "
                             f"{max_seconds / 3600:g} h read here")


def block_frames(audio: "AudioFile") -> int:
    """Frames a read takes: BLOCK_SECONDS of audio, at most BLOCK_SAMPLES samples."""
    return max(1, min(int(audio.input_rate * BLOCK_SECONDS), BLOCK_SAMPLES // audio.channels))


def stamp(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def changed_since_probe(audio: AudioFile) -> str | None:
    """How the file at ``audio.path`` differs from what ``probe`` saw, in a few words, or None."""
    try:
        now = stamp(os.stat(audio.path))
    except OSError as e:
        return f"it can no longer be read ({reason(e)})"
    if now[:2] != audio.stamp[:2]:
        return "it was replaced by another file"
    if now != audio.stamp:
        return ("it was modified (" + (f"{audio.stamp[2]} -> {now[2]} bytes)" if now[2] != audio.stamp[2]
                                       else "written again at the same size)"))
    return None


def modified_in_place(audio: AudioFile) -> bool:
    """The open file (same identity) was written to: truncated, appended or overwritten."""
    try:
        now = stamp(os.stat(audio.path))
    except OSError:
        return False                     # deleted: the open file is still whole
    return now[:2] == audio.stamp[:2] and now != audio.stamp


def stream(audio: AudioFile, stats: SourceStats) -> Iterator[np.ndarray]:
    """The file as consecutive 16 kHz mono float32 chunks (about BLOCK_SECONDS each);
    AudioFileError if the file is not the one ``probe`` checked, or changes while it is read."""
    rs = (soxr.ResampleStream(audio.input_rate, SAMPLE_RATE, 1, dtype="float32")
          if audio.input_rate != SAMPLE_RATE else None)
    if audio.reader == "av":
        yield from _resampled(av_blocks(audio), rs, stats)
        return
    with _open_checked(audio) as f:
        yield from _resampled(native_blocks(audio, f), rs, stats)


def native_blocks(audio: AudioFile, f) -> Iterator[np.ndarray]:
    """The open file ``f`` block by block, (frames, channels) float32 at its own rate;
    AudioFileError if it is damaged after its header or changes while it is read."""
    block = block_frames(audio)
    while True:
        try:
            x = f.read(block, dtype="float32", always_2d=True)
        except Exception as e:  # noqa: BLE001 - a file damaged after its header
            raise AudioFileError(f"{audio.path} is corrupt or truncated after "
                                 f"{f.tell() / audio.input_rate:.1f} s ({reason(e)})") from e
        if modified_in_place(audio):
            raise AudioFileError(f"{audio.path} changed while it was being read, after "
                                 f"{f.tell() / audio.input_rate:.1f} s: "
                                 f"{changed_since_probe(audio)}; the run ends here")
        if len(x) == 0:
            return
        yield x


def _open_checked(audio: AudioFile):
    """The file opened by soundfile, if it is still the file ``probe`` checked."""
    import soundfile as sf

    change = changed_since_probe(audio)
    if change is None:
        try:
            f = sf.SoundFile(os.fsencode(audio.path))
        except Exception as e:  # noqa: BLE001 - soundfile raises several types
            change = f"it can no longer be read ({reason(e)})"
        else:
            now, change = (int(f.samplerate), int(f.channels), int(f.frames)), changed_since_probe(audio)
            if now == (audio.input_rate, audio.channels, audio.frames) and change is None:
                return f                 # the stat after opening: the file opened is the one checked
            f.close()
            change = change or f"it is now {now[0]} Hz, {now[1]} channel(s), {now[2]} frames"
    raise AudioFileError(f"{audio.path} changed since it was checked ({audio.input_rate} Hz, "
                         f"{audio.channels} channel(s), {audio.frames} frames): {change}; "
                         "the run ends here (open it again to read the new file)")


def _resampled(blocks, rs, stats) -> Iterator[np.ndarray]:
    for x in blocks:
        mono = condition(x, stats)
        out = rs.resample_chunk(mono) if rs is not None else mono
        if len(out):
            yield out
    if rs is not None:
        tail = rs.resample_chunk(np.zeros(0, np.float32), last=True)
        if len(tail):
            yield tail


def decode_file(path: str | Path, stats: SourceStats | None = None) -> tuple[np.ndarray, dict]:
    """A whole file -> (16 kHz mono float32, info), for the offline paths (token files): the
    result is held, the file's native samples are not."""
    audio = probe(path, MAX_WHOLE_SECONDS)
    chunks, n = [], 0                                  # sized from what is read, never from the claim
    limit = audio.samples if audio.exact else MAX_WHOLE_SECONDS * SAMPLE_RATE + 1   # av_blocks: the limit
    for chunk in stream(audio, stats if stats is not None else SourceStats()):
        chunks.append(chunk[:limit - n])
        n += len(chunks[-1])
        if n >= limit:
            break
    return (np.concatenate(chunks) if chunks else np.zeros(0, np.float32)), audio.info()


def read_native(path: str | Path) -> tuple[np.ndarray, int]:
    """A whole file at its own rate, (frames, channels) float32, and the rate: blocks read and
    joined (memory from what is read, at most MAX_WHOLE_SECONDS), for the offline musicnn grid."""
    audio = probe(path, MAX_WHOLE_SECONDS)
    if audio.reader == "av":
        blocks = list(av_blocks(audio))
    else:
        with _open_checked(audio) as f:
            blocks = list(native_blocks(audio, f))
    if not blocks:
        raise AudioFileError(f"{path} contains no audio samples")
    return np.concatenate(blocks), audio.input_rate


def _probe_with_av(path: Path, first_error: Exception, max_seconds: float) -> AudioFile:
    """What soundfile cannot read, through PyAV: the first audio track's rate and channels, its
    length from the container (0 when it does not say), and one packet decoded."""
    try:
        with _av_open(path) as container:
            track = _audio_track(container, path)
            rate, channels = int(track.codec_context.sample_rate or 0), int(track.codec_context.channels or 0)
            check_claims(path, rate, channels, 0, max_seconds)
            seconds = (float(track.duration * track.time_base) if track.duration
                       else container.duration / 1e6 if container.duration else 0.0)
            check_claims(path, rate, channels, round(seconds * rate), max_seconds)
            if next(iter(container.decode(track)), None) is None:
                raise AudioFileError(f"{path} contains no audio samples")
    except AudioFileError:
        raise
    except Exception as e:  # noqa: BLE001 - FFmpeg's errors, by type
        raise AudioFileError(f"cannot decode {path}: not audio, corrupt or truncated, or a format without a "
                             f"decoder here (soundfile: {reason(first_error)}; PyAV: {reason(e)})") from e
    return AudioFile(path, rate, channels, round(seconds * rate), reader="av")


def _av_open(path: Path):
    try:
        import av
    except ImportError as e:               # a broken install: PyAV is a dependency
        raise AudioFileError(f"cannot decode {path}: PyAV is not installed (pip install av)") from e
    return av.open(os.fsdecode(path), metadata_errors="ignore")


def _audio_track(container, path):
    track = next((s for s in container.streams if s.type == "audio"), None)
    if track is None:
        raise AudioFileError(f"{path} has no audio track")
    return track


def av_blocks(audio: AudioFile) -> Iterator[np.ndarray]:
    """The file through PyAV, (frames, channels) float32 at its own rate, about BLOCK_SECONDS a
    block; AudioFileError if it is not the file ``probe`` checked, is damaged after its first
    packet, changes while it is read, or decodes to more than its limit (MAX_SECONDS)."""
    import av

    block, done, limit = block_frames(audio), 0, audio.max_seconds * audio.input_rate
    with _av_open(audio.path) as container:
        change = changed_since_probe(audio)          # the stat after opening: the file opened is the one checked
        if change is not None:
            raise AudioFileError(f"{audio.path} changed since it was checked: {change}; the run ends here")
        track = _audio_track(container, audio.path)
        if (int(track.codec_context.sample_rate), int(track.codec_context.channels)) != (audio.input_rate,
                                                                                          audio.channels):
            raise AudioFileError(f"{audio.path} changed since it was checked; the run ends here")
        to_float = av.AudioResampler(format="flt", layout=track.codec_context.layout, rate=audio.input_rate)
        held: list[np.ndarray] = []
        n = 0
        packets = container.decode(track)
        while True:
            try:
                frame = next(packets, None)
                converted = to_float.resample(frame)          # None: the resampler's tail
            except Exception as e:  # noqa: BLE001 - a file damaged after its first packet
                raise AudioFileError(f"{audio.path} is corrupt or truncated after "
                                     f"{done / audio.input_rate:.1f} s ({reason(e)})") from e
            for out in converted:
                x = out.to_ndarray().reshape(-1, audio.channels)
                held.append(x)
                n += len(x)
            if held and (n >= block or frame is None):
                if modified_in_place(audio):                 # once a block, as the soundfile reader
                    raise AudioFileError(f"{audio.path} changed while it was being read, after "
                                         f"{done / audio.input_rate:.1f} s: {changed_since_probe(audio)}; "
                                         "the run ends here")
                x = np.concatenate(held) if len(held) > 1 else held[0]
                held, n = [], 0
                done += len(x)
                if done > limit:
                    raise AudioFileError(f"{audio.path} decodes to more than {audio.max_seconds / 3600:g} h of "
                                         "audio, the most read here")
                yield np.ascontiguousarray(x, dtype=np.float32)
            if frame is None:
                return


def decode_native(path: str | Path) -> tuple[np.ndarray, int, dict]:
    """(mono float32 at the file's own rate, rate, info), as librosa.load(sr=None) gave it:
    channels averaged in float32. Non-finite samples are zeroed (counted in info)."""
    data, rate = read_native(path)                    # header claims checked, sized from what is read
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0].copy()
    bad = ~np.isfinite(mono)
    mono[bad] = 0.0
    return mono, int(rate), {"rate": int(rate), "channels": data.shape[1], "nonfinite": int(bad.sum())}
