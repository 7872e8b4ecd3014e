"""Audio sources: microphone, file, demo signal -> 16 kHz mono float32 hops of 0.25 s.

Every source is an iterator of hops, shape (4000,), and keeps ``stats`` (hops delivered, dropped,
input overflows, non-finite samples replaced by 0, clipped samples). Input is made safe the same
way everywhere (``condition``): channels are averaged to mono, NaN/Inf become 0 (counted), samples
beyond +-1 are clipped (counted), then audio is resampled to 16 kHz with soxr.

``sounddevice`` is imported only when a microphone is used, so files and the demo signal work on a
machine without PortAudio.
"""
from __future__ import annotations

import functools
import math
import queue
import threading
import time
from pathlib import Path

import numpy as np
import soxr

from .decoding import SourceStats, condition, probe, stream
from .errors import AudioDeviceError, DeviceLostError, printable
from .melspec import HOP, HOP_SECONDS, SAMPLE_RATE, num_tokens


SPEEDS = (0.5, 1.0, 2.0, 4.0, 8.0)     # playback speeds a file or the demo offers (1: a sound card's)


def check_speed(speed: float) -> float:
    """``speed`` if it is one of SPEEDS; ValueError naming them otherwise."""
    if speed not in SPEEDS:
        raise ValueError(f"a playback speed is one of {', '.join(f'{s:g}' for s in SPEEDS)}, got {speed!r}")
    return float(speed)


class RealtimeClock:
    """Paces hops like a sound card playing at ``speed()`` times real time: each hop is
    available one hop's duration / speed after the one before (read at every hop, so a change
    of speed takes effect at the next hop).

    ``wait()`` returns the time the next hop became available (after sleeping until then), False
    if the consumer is more than ``max_lag`` hops behind (that hop is dropped and counted, as a
    sound card's buffer would overrun), or None if stopped.
    """

    def __init__(self, stats: SourceStats, stop: threading.Event, max_lag: int = 4,
                 paused: threading.Event | None = None, speed=lambda: 1.0):
        self.stats, self.stop, self.max_lag, self.speed = stats, stop, max_lag, speed
        self.paused = paused or threading.Event()
        self.due = time.monotonic()           # when the last hop was (or would have been) available

    def wait(self):
        if self.paused.is_set():              # hold the position; the pause does not count as lag
            t0 = time.monotonic()
            while self.paused.is_set():
                if self.stop.wait(0.05):
                    return None
            self.due += time.monotonic() - t0
        period = HOP_SECONDS / self.speed()
        self.due += period
        due, now = self.due, time.monotonic()
        if now - due > self.max_lag * period:
            self.stats.dropped += 1
            return False
        if due > now and self.stop.wait(due - now):
            return None
        return due


def paced(source) -> RealtimeClock | None:
    """A real-time ``source``'s clock, at its (changeable) ``speed``; None when it runs as fast
    as it is read."""
    if not source.realtime:
        return None
    return RealtimeClock(source.stats, source._stop, paused=source.paused, speed=lambda: source.speed)


class FileSource:
    """Hops of a file, decoded block by block as they are taken (audio/decoding.py): as fast as
    possible, or paced in real time at ``speed`` (SPEEDS; ``speed`` may change as it plays);
    optionally looped. Memory does not grow with the file.

    Token count follows ``melspec.num_tokens``: the trailing partial hop is not classified, and a
    file shorter than one hop gives one zero-padded hop.
    """

    def __init__(self, path: str | Path, *, realtime: bool = False, loop: bool = False, speed: float = 1.0):
        self.stats = SourceStats()
        self.speed = check_speed(speed)
        self.audio = probe(path)              # a bad file fails here, before any model loads
        self.info = self.audio.info()
        self.name = f"file:{printable(Path(path).name)}"      # a non-UTF-8 name shows its bytes as \xff
        self.input_rate = self.info["input_rate"]
        self.realtime, self.loop = realtime, loop
        self._stop = threading.Event()
        self.paused = threading.Event()   # set: hold the playback position (real-time only)

    def hops(self) -> int:
        return num_tokens(self.audio.samples)

    def signal_hops(self, stats: SourceStats):
        """(HOP,) hops of one pass over the file."""
        pending, sent = np.zeros(0, np.float32), 0
        for chunk in stream(self.audio, stats):
            pending = np.concatenate([pending, chunk])
            while len(pending) >= HOP:
                yield pending[:HOP]
                pending, sent = pending[HOP:], sent + 1
        if sent == 0 and len(pending):
            yield np.pad(pending, (0, HOP - len(pending)))

    def __iter__(self):
        clock = paced(self)
        self.last_ready = None
        stats = self.stats                   # repaired samples are counted on the first pass
        while not self._stop.is_set():
            for hop in self.signal_hops(stats):
                if self._stop.is_set():
                    return
                if clock is not None:    # a hop is available once its last sample has "played"
                    ready = clock.wait()
                    if ready is None:
                        return
                    if ready is False:   # the consumer fell behind: this hop is dropped
                        continue
                    self.last_ready = ready
                self.stats.hops += 1
                yield hop
            if not self.loop:
                return
            stats = SourceStats()

    def close(self) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------- demo signal

class DemoSource:
    """A deterministic synthetic piece (no third-party audio): 120 BPM, a bass line, a
    four-chord progression with harmonics and decay, and a seeded noise hi-hat on off-beats.
    Real time: paced at ``speed``, as a file is."""

    CHORDS = ((220.00, 277.18, 329.63), (174.61, 220.00, 261.63),
              (196.00, 246.94, 293.66), (164.81, 207.65, 246.94))

    def __init__(self, *, seed: int = 0, realtime: bool = False, seconds: float | None = None,
                 speed: float = 1.0):
        self.stats = SourceStats()
        self.speed = check_speed(speed)
        self.name, self.input_rate = "demo", SAMPLE_RATE
        self.seed, self.realtime, self.seconds = seed, realtime, seconds
        self._stop = threading.Event()
        self.paused = threading.Event()   # set: hold the playback position (real-time only)

    def render(self, start: int, count: int) -> np.ndarray:
        """Samples [start, start + count) of the piece, float32 in [-1, 1]."""
        tonal, hat, quiet = _demo_tonal(start, count)
        if quiet is not None:         # no hi-hat here (half the hops): the same values for every seed
            return quiet.copy()
        return np.clip(tonal + _noise(self.seed, start, count) * hat, -1, 1).astype(np.float32)

    def __iter__(self):
        clock = paced(self)
        self.last_ready = None
        total = math.inf if self.seconds is None else int(self.seconds / HOP_SECONDS)
        t = 0
        while t < total and not self._stop.is_set():
            if clock is not None:
                ready = clock.wait()
                if ready is None:
                    return
                if ready is False:       # the consumer fell behind: this hop is dropped
                    t += 1
                    continue
                self.last_ready = ready
            self.stats.hops += 1
            yield self.render(t * HOP, HOP)
            t += 1

    def close(self) -> None:
        self._stop.set()


@functools.lru_cache(maxsize=16)
def _demo_tonal(start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The demo piece's seed-independent part over samples [start, start + count): chords and
    bass (float64), the hi-hat's gain on its noise (0.05 x its decay on off-beats, else 0), and
    where no hi-hat plays, the samples themselves (float32, clipped; else None). Computed once
    for all demo streams at that position, the same read-only arrays handed to each."""
    t = np.arange(start, start + count) / SAMPLE_RATE
    beat = 0.5                                           # seconds per beat (120 BPM)
    bar = (t // (4 * beat)).astype(int) % 4
    in_beat = (t % beat) / beat
    env = np.exp(-4.0 * in_beat)
    out = np.zeros(count)
    for i, chord in enumerate(DemoSource.CHORDS):
        mask = bar == i
        if not mask.any():
            continue
        for f in chord:
            for h, a in ((1, 0.12), (2, 0.05), (3, 0.025)):
                out[mask] += a * env[mask] * np.sin(2 * np.pi * f * h * t[mask])
        out[mask] += 0.2 * np.exp(-6 * in_beat[mask]) * np.sin(2 * np.pi * chord[0] / 2 * t[mask])
    off_beat = (t % beat) >= beat / 2
    hat = np.where(off_beat, 0.05 * np.exp(-30 * ((t % (beat / 2)) / beat)), 0.0)
    quiet = None if off_beat.any() else np.clip(out, -1, 1).astype(np.float32)
    for a in (out, hat, quiet):
        if a is not None:
            a.flags.writeable = False
    return out, hat, quiet


NOISE_SAMPLES = 1 << 18              # 16.4 s of the hi-hat's noise, shared by every seed
NOISE_STRIDE = 104_729               # samples between two seeds' starts in it (a prime: odd)


@functools.cache
def _noise_table() -> np.ndarray:
    """(NOISE_SAMPLES,) standard normal float64, drawn once (seed 0), read-only."""
    table = np.random.default_rng(0).standard_normal(NOISE_SAMPLES)
    table.flags.writeable = False
    return table


def _noise(seed: int, start: int, count: int) -> np.ndarray:
    """The hi-hat noise of stream ``seed`` over samples [start, start + count): the shared
    table read from the seed's own offset, cyclically (a view where it does not wrap): no
    generator seeded and no 4,000 normals drawn per stream per hop, so that many demo streams
    (`bench --streams`) cost the host little."""
    i = (seed * NOISE_STRIDE + start) % NOISE_SAMPLES
    table = _noise_table()
    if i + count <= NOISE_SAMPLES:
        return table[i:i + count]
    return np.take(table, np.arange(i, i + count) % NOISE_SAMPLES)


# ----------------------------------------------------------------------------- microphone

def import_sounddevice():
    """sounddevice, or a typed error saying how to get PortAudio."""
    try:
        import sounddevice
    except OSError as e:
        raise AudioDeviceError("PortAudio is missing, so no microphone can be opened: install "
                               "Debian's libportaudio2 (apt-get install libportaudio2)") from e
    return sounddevice


def list_input_devices() -> list[dict]:
    """Input devices: index, name, host API, channels, default sample rate."""
    sd = import_sounddevice()
    hostapis = sd.query_hostapis()
    return [{"index": i, "name": d["name"], "hostapi": hostapis[d["hostapi"]]["name"],
             "channels": d["max_input_channels"], "default_rate": d["default_samplerate"]}
            for i, d in enumerate(sd.query_devices()) if d["max_input_channels"] > 0]


def find_input_device(device: int | str | None) -> dict:
    """The input device by index, exact or partial name, or the default one."""
    devices = list_input_devices()
    if not devices:
        raise AudioDeviceError("no audio input device found: connect a microphone (or start an "
                               "audio server), or use a file or the demo signal")
    names = ", ".join(f"{d['index']}: {d['name']}" for d in devices)
    if device is None:
        sd = import_sounddevice()
        default = sd.default.device[0]
        for d in devices:
            if d["index"] == default:
                return d
        return devices[0]
    if isinstance(device, int) or str(device).isdigit():
        for d in devices:
            if d["index"] == int(device):
                return d
        raise AudioDeviceError(f"no input device with index {device}; inputs: {names}")
    exact = [d for d in devices if d["name"] == device]
    partial = [d for d in devices if str(device).lower() in d["name"].lower()]
    if exact or len(partial) == 1:
        return (exact or partial)[0]
    if partial:
        raise AudioDeviceError(f"device name {device!r} is ambiguous; inputs: {names}")
    raise AudioDeviceError(f"no input device named {device!r}; inputs: {names}")


class MicrophoneSource:
    """Captures from an input device in PortAudio's callback thread.

    The callback converts to mono, sanitises, resamples to 16 kHz (soxr, streaming) and puts
    complete 0.25 s hops into a bounded queue; if the consumer falls behind, the oldest hop is
    dropped and counted. Iterating yields hops; a device that stops delivering audio for
    ``lost_after`` seconds (or whose stream ends) raises DeviceLostError.
    """

    def __init__(self, device: int | str | None = None, *, samplerate: float | None = None,
                 max_queued_hops: int = 16, lost_after: float = 2.0):
        self._sd = import_sounddevice()
        self.device = find_input_device(device)
        self.input_rate = int(samplerate or self.device["default_rate"])
        self.name = f"mic:{self.device['name']}"
        self.stats = SourceStats()
        self.lost_after = lost_after
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued_hops)
        self._resampler = (soxr.ResampleStream(self.input_rate, SAMPLE_RATE, 1, dtype="float32")
                           if self.input_rate != SAMPLE_RATE else None)
        self._pending = np.zeros(0, dtype=np.float32)
        self.last_ready: float | None = None   # time.monotonic() when the last hop completed
        self._stream = None
        self._ended = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        self.paused = threading.Event()   # set: captured hops are discarded (not counted as drops)

    # runs in PortAudio's thread
    def _callback(self, indata, frames, time_info, status) -> None:
        if status.input_overflow:
            self.stats.overflows += 1
        x = condition(indata, self.stats)
        if self._resampler is not None:
            x = self._resampler.resample_chunk(x)
        with self._lock:
            self._pending = np.concatenate([self._pending, x])
            while len(self._pending) >= HOP:
                hop, self._pending = self._pending[:HOP].copy(), self._pending[HOP:]
                self._offer((hop, time.monotonic()))

    def _offer(self, hop: tuple[np.ndarray, float]) -> None:   # (samples, ready time)
        while True:
            try:
                self._queue.put_nowait(hop)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()        # keep the newest audio
                    self.stats.dropped += 1
                except queue.Empty:
                    pass

    def start(self) -> "MicrophoneSource":
        try:
            self._stream = self._sd.InputStream(
                device=self.device["index"], channels=1, samplerate=self.input_rate,
                dtype="float32", blocksize=int(self.input_rate * 0.05), callback=self._callback,
                finished_callback=self._ended.set)
            self._stream.start()
        except Exception as e:  # noqa: BLE001 - PortAudioError and ValueError
            raise AudioDeviceError(f"cannot open input device {self.device['name']!r} at "
                                   f"{self.input_rate} Hz: {e}") from e
        return self

    def __iter__(self):
        if self._stream is None:
            self.start()
        last = time.monotonic()
        while True:
            try:
                hop = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._closing:
                    return
                if self._ended.is_set() or time.monotonic() - last > self.lost_after:
                    self.close(wait=0.0)
                    raise DeviceLostError(
                        f"input device {self.device['name']!r} stopped delivering audio "
                        f"(unplugged, or its audio server stopped); choose another source")
                continue
            if hop is None:
                return
            hop, self.last_ready = hop
            last = time.monotonic()
            if self.paused.is_set():
                continue
            self.stats.hops += 1
            yield hop

    def close(self, wait: float = 0.5) -> None:
        """Stop capturing and end the iteration, within ``wait`` seconds.

        The stream is aborted in a helper thread: with a vanished device PortAudio's abort can
        block, and a caller (the GUI, the CLI) must never hang on it.
        """
        self._closing = True
        stream, self._stream = self._stream, None
        if stream is not None:
            def shut():
                try:
                    stream.abort(ignore_errors=True)
                    stream.close(ignore_errors=True)
                except Exception:  # noqa: BLE001 - a vanished device may fail to close
                    pass
            closer = threading.Thread(target=shut, name="nystream-mic-close", daemon=True)
            closer.start()
            closer.join(wait)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
