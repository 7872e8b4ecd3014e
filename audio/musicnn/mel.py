"""musicnn's log-mel input, as the original implementation computed it, offline or per hop.

The original (``musicnn.extractor.batch_data``, librosa 0.6/0.7 era):
  librosa.load(sr=16000): float32 mono, resampled with resampy 0.2.2's ``kaiser_best`` filter,
      then zero-padded to ceil(len * 16000 / sr) samples;
  melspectrogram: STFT n_fft 512, hop 256, periodic Hann, centred with *reflect* padding,
      power 2, 96 Slaney mel bands (0 - 8 kHz), in float32;
  cast to float16, then log10(10000 x + 1) in float32 (numpy 1 promoted the product to float32;
      under numpy 2 the float16 product would overflow, so it is done in float32 here);
  patches of 187 frames (3 s) every 61 frames (~1 s).

Rounded as the original rounds (the spectrum, power and mel product to float32, the mel to
float16), but each of those values is computed in float64 and rounded once: |X|^2 as re^2 + im^2
(the original squared a float32 magnitude), the mel product and the logarithm in float64. Then
the result does not depend on the library, the processor or the device that computes it:
``log_mel_of_frames`` (numpy, the host) and ``log_mel_of_frames_torch`` (any torch device, many
streams' frames in one call) agree bit for bit, except where two libraries' float64 results
(an FFT, a matrix product) fall on either side of a float32 rounding boundary: about 2^-28 of
the values, each then one float32 step apart. A float32 product summed in another order would
move about a tenth of the mel values by a float32 step, and some of those by a float16 step.

``resample_kaiser_best`` re-implements resampy 0.2.2's interpolation loop (same arithmetic and
order, float32 accumulation) with the filter table read from the installed resampy 0.2.2
(see ``kaiser_best_path``); later resampy versions regenerated that table and move
taggrams by up to 0.25, so the token files can only be reproduced with this one.

Streaming (``StreamingMel``): frame i is centred on sample 256 i (the first frame reflect-padded
at the stream start), so after h hops of 4000 samples floor(15.625 h) frames are complete; each
hop yields its 15 or 16 new frames.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from ..errors import AudioFileError, MusicnnWeightsError

SAMPLE_RATE = 16000
N_FFT = 512
FRAME_HOP = 256              # samples per mel frame
BANDS = 96
PATCH_FRAMES = 187           # 3 s
PATCH_HOP = 61               # frames between the original implementation's patches (~0.98 s)
RESAMPY_INSTALL = ("pip install --no-deps --target <python prefix>/vendor/resampy-0.2.2 "
                   "resampy==0.2.2 (or: make setup)")


def slaney_hz(mels: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (the Auditory Toolbox's, librosa's default) back to Hz: linear below
    1 kHz (200/3 Hz a mel), logarithmic above it (a factor 6.4 every 27 mels)."""
    f_sp, log_hz = 200.0 / 3, 1000.0
    log_mel, log_step = log_hz / f_sp, np.log(6.4) / 27.0
    hz = f_sp * mels
    above = mels >= log_mel
    hz[above] = log_hz * np.exp(log_step * (mels[above] - log_mel))
    return hz


def _mel_basis() -> np.ndarray:
    """(257, 96) float32: 96 triangular Slaney-normalised bands from 0 to 8 kHz over the 257 bins
    of a 512-point FFT at 16 kHz. librosa.filters.mel's arithmetic step for step (the triangles
    in float64, stored in float32, scaled by 2 / band width in float64, stored in float32), so
    the same bits (tests/audio/test_audio_musicnn.py) without importing librosa and scipy.signal
    (1.5 s of every engine's start)."""
    top_mel = 1000.0 / (200.0 / 3) + np.log(SAMPLE_RATE / 2 / 1000.0) / (np.log(6.4) / 27.0)
    edges = slaney_hz(np.linspace(0.0, top_mel, BANDS + 2))                  # (98,) Hz
    ramps = np.subtract.outer(edges, np.fft.rfftfreq(N_FFT, 1.0 / SAMPLE_RATE))   # (98, 257)
    width = np.diff(edges)
    weights = np.zeros((BANDS, N_FFT // 2 + 1), dtype=np.float32)
    for i in range(BANDS):
        weights[i] = np.maximum(0, np.minimum(-ramps[i] / width[i], ramps[i + 2] / width[i + 1]))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.T


_MEL = _MEL64 = None
_WINDOW = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)     # periodic Hann, float64


def mel_basis() -> np.ndarray:
    global _MEL
    if _MEL is None:
        _MEL = _mel_basis()
    return _MEL


def mel_basis64() -> np.ndarray:
    """The float32 basis, exactly, in float64 (the mel product's)."""
    global _MEL64
    if _MEL64 is None:
        _MEL64 = mel_basis().astype(np.float64)
    return _MEL64


def log_mel_of_frames(frames: np.ndarray) -> np.ndarray:
    """(F, 512) float32 sample frames -> (F, 96) float32 log-mel, as the original computed it
    (its roundings; each value computed in float64 and rounded once, see above)."""
    spectrum = np.fft.rfft(frames.astype(np.float64) * _WINDOW, axis=1).astype(np.complex64)
    re, im = spectrum.real.astype(np.float64), spectrum.imag.astype(np.float64)
    power = (re * re + im * im).astype(np.float32)
    mel = (power.astype(np.float64) @ mel_basis64()).astype(np.float32)
    mel = mel.astype(np.float16).astype(np.float32)
    return np.log10((np.float32(10000.0) * mel + np.float32(1.0)).astype(np.float64)).astype(np.float32)


_ON_DEVICE: dict = {}


def log_mel_of_frames_torch(frames):
    """The same on a torch device: (F, 512) float32 tensor -> (F, 96) float32 tensor, equal to
    ``log_mel_of_frames`` bit for bit but for the float64 boundary cases above."""
    import torch
    if frames.device not in _ON_DEVICE:              # the window and the mel basis, copied once
        _ON_DEVICE[frames.device] = (torch.from_numpy(_WINDOW).to(frames.device),
                                     torch.from_numpy(mel_basis64()).to(frames.device))
    window, basis = _ON_DEVICE[frames.device]
    spectrum = torch.fft.rfft(frames.double() * window, dim=-1).to(torch.complex64)
    re, im = spectrum.real.double(), spectrum.imag.double()
    power = (re * re + im * im).float()
    mel = (power.double() @ basis).float().half().float()
    return torch.log10((mel * 10000.0 + 1.0).double()).float()


def _frames(padded: np.ndarray, count: int) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(
        padded, shape=(count, N_FFT), strides=(padded.strides[0] * FRAME_HOP, padded.strides[0]))


def log_mel(signal: np.ndarray) -> np.ndarray:
    """(samples,) 16 kHz float32 -> (1 + samples // 256, 96) float32, centred, reflect-padded."""
    y = np.ascontiguousarray(signal, dtype=np.float32)
    if len(y) <= N_FFT // 2:
        raise AudioFileError(f"{len(y)} samples are too few for a musicnn log-mel frame")
    padded = np.pad(y, N_FFT // 2, mode="reflect")
    return log_mel_of_frames(_frames(padded, 1 + len(y) // FRAME_HOP))


def patch_starts(frames: int) -> list[int]:
    """First frames of the original implementation's patches (every 61 frames, all complete);
    a log-mel shorter than one patch gives one patch at 0 (to be zero-padded)."""
    return list(range(0, frames - PATCH_FRAMES + 1, PATCH_HOP)) or [0]


def offline_patches(signal: np.ndarray) -> np.ndarray:
    """(samples,) 16 kHz -> (P, 187, 96) float32 patches on the original grid (silence-padded
    to one patch when shorter)."""
    mel = log_mel(signal)
    if len(mel) < PATCH_FRAMES:
        mel = np.concatenate([mel, np.zeros((PATCH_FRAMES - len(mel), BANDS), np.float32)])
    starts = patch_starts(len(mel))
    return np.stack([mel[s:s + PATCH_FRAMES] for s in starts])


class StreamingMel:
    """One 0.25 s hop (4000 samples, 16 kHz) in, the mel frames it completes out ((15|16, 96))."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.buffer = np.zeros(0, np.float32)     # padded samples from the next frame's start on
        self.emitted = 0                           # frames emitted so far
        self.started = False

    def push(self, hop: np.ndarray) -> np.ndarray:
        """The hop's new log-mel frames (k, 96)."""
        return log_mel_of_frames(self.frames(hop))

    def frames(self, hop: np.ndarray) -> np.ndarray:
        """The sample frames (k, 512) the hop completes (their log-mel: ``push``)."""
        x = np.asarray(hop, dtype=np.float32)
        if not self.started:
            if len(x) <= N_FFT // 2:
                raise ValueError(f"the first hop needs more than {N_FFT // 2} samples for the "
                                 f"reflect padding, got {len(x)}")
            x = np.concatenate([x[1:N_FFT // 2 + 1][::-1], x])
            self.started = True
        self.buffer = np.concatenate([self.buffer, x])
        count = 1 + (len(self.buffer) - N_FFT) // FRAME_HOP if len(self.buffer) >= N_FFT else 0
        if count == 0:
            return np.zeros((0, N_FFT), np.float32)
        out = _frames(self.buffer, count)             # a view of the buffer, which is replaced below
        self.buffer = self.buffer[count * FRAME_HOP:].copy()
        self.emitted += count
        return out


class SlotFrames:
    """``StreamingMel.frames`` for many streams in one call on a torch device. Each slot's
    samples not yet framed (at most 511) wait in a row of ``tail``; a hop's frames of every
    stream are gathered at once from those and the new samples (on CUDA: one copy of the hops
    to the device, no per-stream work on the host). The frames are StreamingMel's bit for bit:
    the same samples, moved (tests/audio/test_audio_musicnn.py).

    Shapes: C slots, S streams pushed, n samples a hop (at most), F frames of the hop."""

    def __init__(self, capacity: int, device):
        import torch
        self.device = torch.device(device)
        self.tail = torch.zeros(capacity, N_FFT, device=self.device)    # (C, 512) carried samples, from column 0
        self.carried = np.zeros(capacity, np.int64)                      # (C,) how many
        self.started = np.zeros(capacity, bool)                          # (C,) first hop taken (reflect-padded)

    def reset(self, slot: int) -> None:
        self.carried[slot], self.started[slot] = 0, False

    def frames(self, slots, hops: list[np.ndarray]):
        """hops[i]: stream ``slots[i]``'s new samples -> ((F, 512) float32 frames on the device,
        stream after stream; (S,) how many each stream's hop completed)."""
        import torch
        from .batch import on_device
        slots = np.asarray(slots, np.int64)
        n = np.array([len(h) for h in hops], np.int64)
        first = ~self.started[slots]
        if (n[first] <= N_FFT // 2).any():
            raise ValueError(f"the first hop needs more than {N_FFT // 2} samples for the reflect padding, "
                             f"got {int(n[first].min())}")
        if len(set(n.tolist())) <= 1:
            x = np.stack([np.asarray(h, np.float32) for h in hops]) if len(hops) else np.zeros((0, 0), np.float32)
        else:                                          # uneven hops: zero-padded to the longest (never read)
            x = np.zeros((len(hops), n.max()), np.float32)
            for row, h in zip(x, hops):
                row[:len(h)] = h
        c, pre = self.carried[slots], np.where(first, N_FFT // 2, 0)
        length = c + pre + n                                            # (S,) samples to frame
        counts = np.where(length >= N_FFT, 1 + (length - N_FFT) // FRAME_HOP, 0)
        keep = length - counts * FRAME_HOP                              # (S,) carried to the next hop
        dev = self.device
        x = on_device(x, dev)                                           # (S, n)
        at = lambda a: on_device(np.ascontiguousarray(a), dev)                # noqa: E731 (pinned, no wait)
        rows = at(slots)
        prefix = x[:, 1:N_FFT // 2 + 1].flip(1) if x.shape[1] > N_FFT // 2 else x.new_zeros(len(hops), N_FFT // 2)
        source = torch.cat([self.tail.index_select(0, rows), prefix, x], dim=1)      # (S, 768 + n)
        stream = np.repeat(np.arange(len(hops)), counts)                            # (F,) each frame's stream
        starts = (np.arange(len(stream)) - np.repeat(np.cumsum(counts) - counts, counts)) * FRAME_HOP
        lanes = torch.arange(N_FFT, device=dev)
        frames = source[at(stream)[:, None], self._column(at(starts)[:, None] + lanes, at(c[stream])[:, None],
                                                          at(pre[stream])[:, None], source.shape[1])]
        tail = source.gather(1, self._column(at(counts * FRAME_HOP)[:, None] + lanes, at(c)[:, None],
                                             at(pre)[:, None], source.shape[1]))
        self.tail.index_copy_(0, rows, tail)
        self.carried[slots], self.started[slots] = keep, True
        return frames, counts

    @staticmethod
    def _column(position, carried, pre, width):
        """Where position p of a stream's buffer (its carried samples, the reflect padding of a
        first hop, the hop) sits in its row of ``source`` ([tail 512 | padding 256 | hop])."""
        import torch
        p = torch.where(position < carried, position,
                        torch.where(position < carried + pre, N_FFT + position - carried,
                                    N_FFT + N_FFT // 2 + position - carried - pre))
        return p.clamp(max=width - 1)                   # past the buffer: never read


# ----------------------------------------------------------------------------- resampling

def kaiser_best_path() -> Path:
    """Where resampy 0.2.2's filter table is: ``$NYSTREAM_KAISER_BEST``, else the copy of that
    release that ``make setup`` installs beside the environment (``<prefix>/vendor/``). It
    cannot live in site-packages: torchvggish pulls in a current resampy there."""
    if os.environ.get("NYSTREAM_KAISER_BEST"):
        return Path(os.environ["NYSTREAM_KAISER_BEST"])
    return Path(sys.prefix) / "vendor" / "resampy-0.2.2" / "resampy" / "data" / "kaiser_best.npz"


def _kaiser_best_table() -> tuple[np.ndarray, int]:
    path = kaiser_best_path()
    if not path.is_file():
        raise MusicnnWeightsError(
            f"reproducing the musicnn token files needs the kaiser_best filter table of resampy "
            f"0.2.2 (later versions changed it), looked for at {path}; install it with: "
            f"{RESAMPY_INSTALL}")
    data = np.load(path)
    return data["half_window"].astype(np.float64), int(data["precision"])


def _interpolate(x, y, ratio, win, delta, table_size):    # numba-compiled below
    """resampy 0.2.2's band-limited interpolation, same arithmetic: x (N,) -> y (M,) (zeros in)."""
    scale = min(1.0, ratio)
    step = int(scale * table_size)
    nwin = win.shape[0]
    position = 0.0
    for t in range(y.shape[0]):
        n = int(position)
        frac = scale * (position - n)
        index = frac * table_size
        offset = int(index)
        eta = index - offset
        for i in range(min(n + 1, (nwin - offset) // step)):      # left wing: x[n], x[n-1], ...
            y[t] += (win[offset + i * step] + eta * delta[offset + i * step]) * x[n - i]
        frac = scale - frac
        index = frac * table_size
        offset = int(index)
        eta = index - offset
        for k in range(min(x.shape[0] - n - 1, (nwin - offset) // step)):   # right wing
            y[t] += (win[offset + k * step] + eta * delta[offset + k * step]) * x[n + k + 1]
        position += 1.0 / ratio


try:
    import numba
    _interpolate = numba.njit(nogil=True, cache=False)(_interpolate)
except ImportError:  # pragma: no cover - numba ships with librosa
    pass


def resample_kaiser_best(x: np.ndarray, sr_in: int, sr_out: int = SAMPLE_RATE) -> np.ndarray:
    """float32 (N,) at ``sr_in`` -> float32 at ``sr_out``, length ceil(N * sr_out / sr_in), as
    librosa.load(sr=...) with resampy 0.2.2 gave it."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if sr_in == sr_out:
        return x.copy()
    ratio = float(sr_out) / sr_in
    win, table_size = _kaiser_best_table()
    if ratio < 1:
        win = win * ratio
    delta = np.zeros_like(win)
    delta[:-1] = np.diff(win)
    y = np.zeros(int(len(x) * ratio), dtype=np.float32)
    _interpolate(x, y, ratio, win, delta, table_size)
    n_out = int(np.ceil(len(x) * ratio))
    return np.concatenate([y, np.zeros(n_out - len(y), np.float32)]) if n_out > len(y) else y
