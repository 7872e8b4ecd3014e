"""VGGish's log-mel front end, exact, computed offline or one 0.25 s hop at a time.

VGGish (Hershey et al.) input: 16 kHz mono, 25 ms periodic Hann window (400 samples), 10 ms hop
(160), 512-point FFT magnitude, 64 mel bands from 125 to 7500 Hz on the HTK mel scale
(1127 ln(1 + f/700)), log(mel + 0.01), patches of 96 frames x 64 bands.

Timing (see ARCHITECTURE.md): token t covers the audio that ends at (t+1) * 0.25 s. The signal is
zero-padded before its start by PAD = 11600 samples, and frame i covers padded samples
[160 i, 160 i + 400). Then token t is exactly frames 25 t .. 25 t + 95, its last frame ends at the
hop boundary, and each 0.25 s hop (4000 samples) adds 25 new frames: a stream computes only those.
"""
from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16000
HOP = 4000                 # samples per token (0.25 s)
HOP_SECONDS = HOP / SAMPLE_RATE       # 0.25: one token, one prediction
HOP_MS = 1000 * HOP_SECONDS           # 250
HOPS_PER_MINUTE = int(round(60 / HOP_SECONDS))   # 240
WIN = 400                  # 25 ms
STEP = 160                 # 10 ms
FFT = 512
BANDS = 64
FRAMES = 96                # frames per patch
FRAMES_PER_HOP = HOP // STEP   # 25
PAD = FRAMES * STEP - HOP + WIN - STEP   # 11600 zeros before the first sample
LOG_OFFSET = 0.01
MEL_LOW, MEL_HIGH = 125.0, 7500.0


def hz_to_mel(f):
    return 1127.0 * np.log(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


def mel_matrix() -> np.ndarray:
    """(FFT/2 + 1, BANDS) triangular HTK mel weights, VGGish's definition (DC bin zeroed)."""
    bins_mel = hz_to_mel(np.linspace(0.0, SAMPLE_RATE / 2, FFT // 2 + 1))
    edges = np.linspace(hz_to_mel(MEL_LOW), hz_to_mel(MEL_HIGH), BANDS + 2)
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
    up = (bins_mel[:, None] - lower) / (centre - lower)
    down = (upper - bins_mel[:, None]) / (upper - centre)
    weights = np.maximum(0.0, np.minimum(up, down))
    weights[0, :] = 0.0
    return weights


_MEL = mel_matrix()
_WINDOW = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(WIN) / WIN)      # periodic Hann


def log_mel_frames(signal: np.ndarray) -> np.ndarray:
    """All complete frames of a 16 kHz signal: (samples,) -> (frames, 64) float64."""
    signal = np.asarray(signal, dtype=np.float64)
    count = 1 + (len(signal) - WIN) // STEP if len(signal) >= WIN else 0
    if count == 0:
        return np.zeros((0, BANDS))
    frames = np.lib.stride_tricks.as_strided(
        signal, shape=(count, WIN), strides=(signal.strides[0] * STEP, signal.strides[0]))
    magnitude = np.abs(np.fft.rfft(frames * _WINDOW, FFT))
    return np.log(magnitude @ _MEL + LOG_OFFSET)


def num_tokens(samples: int) -> int:
    """Tokens for a signal of ``samples`` at 16 kHz: complete hops; a non-empty signal shorter
    than one hop gives one token (its hop zero-padded)."""
    return max(1, samples // HOP) if samples > 0 else 0


def offline_patches(signal: np.ndarray) -> np.ndarray:
    """(samples,) 16 kHz -> (T, 96, 64) float32 patches, token t ending at (t+1) * 0.25 s."""
    T = num_tokens(len(signal))
    padded = np.zeros(PAD + T * HOP)
    usable = min(len(signal), T * HOP)
    padded[PAD:PAD + usable] = signal[:usable]
    frames = log_mel_frames(padded)                       # (25 T + 71, 64)
    index = FRAMES_PER_HOP * np.arange(T)[:, None] + np.arange(FRAMES)
    return frames[index].astype(np.float32)


class StreamingLogMel:
    """One hop in, the newest 96 x 64 patch out; only the hop's 25 new frames are computed."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        silence = log_mel_frames(np.zeros(WIN))[0]
        self.frames = np.tile(silence, (FRAMES, 1))        # ring of the last 96 frames
        self.tail = np.zeros(WIN - STEP)                    # last 240 samples (frame overlap)
        self.hops = 0

    def push(self, hop: np.ndarray) -> np.ndarray:
        """hop: (4000,) float 16 kHz -> (96, 64) float32 patch of the 0.96 s ending with it."""
        if hop.shape != (HOP,):
            raise ValueError(f"a hop is ({HOP},) samples at {SAMPLE_RATE} Hz, got {hop.shape}")
        buf = np.concatenate([self.tail, hop])
        new = log_mel_frames(buf)                          # (25, 64)
        self.frames = np.concatenate([self.frames[FRAMES_PER_HOP:], new])
        self.tail = buf[-(WIN - STEP):]
        self.hops += 1
        return self.frames.astype(np.float32)
