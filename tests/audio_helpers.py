"""Audio files the tests make themselves (no third-party audio needed)."""
from pathlib import Path

import numpy as np
import soundfile as sf


def tone(seconds: float, rate: int, freq: float = 440.0, channels: int = 1, amp: float = 0.5):
    t = np.arange(int(seconds * rate)) / rate
    x = amp * np.sin(2 * np.pi * freq * t)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


def write(path: Path, data, rate: int, subtype: str | None = None) -> Path:
    sf.write(str(path), data, rate, subtype=subtype)
    return path


def dominant_frequency(x: np.ndarray, rate: int = 16000) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[spectrum.argmax()])


def first_seconds(src: Path, folder: Path, seconds: float) -> Path:
    """The first ``seconds`` of the 16-bit file ``src`` (a real excerpt, its samples unchanged) as
    ``folder / src.name``: the same audio in a test that needs less of it."""
    audio, rate = sf.read(src, dtype="int16")
    return write(folder / src.name, audio[:int(seconds * rate)], rate, "PCM_16")
