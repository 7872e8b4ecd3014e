"""assets/sample/prelude-bwv846.ogg, the clip the README's first example classifies: the first
eight bars of J. S. Bach's Prelude in C major (BWV 846, public domain), each note an additive
synthesis of a piano-like tone (slightly inharmonic partials, each decaying faster than the one
below). This project's own rendering, dedicated to the public domain (CC0 1.0).

    .venv/bin/python scripts/make_sample.py assets/sample/prelude-bwv846.ogg
"""
import sys
import numpy as np
import soundfile as sf

RATE = 22050
SIXTEENTH = 0.16
NOTE = {"B3": 59, "C4": 60, "D4": 62, "E4": 64, "F4": 65, "F#4": 66, "G4": 67, "A4": 69, "B4": 71,
        "C5": 72, "D5": 74, "E5": 76, "F5": 77, "G5": 79, "A5": 81}
BARS = ["C4 E4 G4 C5 E5", "C4 D4 A4 D5 F5", "B3 D4 G4 D5 F5", "C4 E4 G4 C5 E5",     # each bar's five notes,
        "C4 E4 A4 E5 A5", "C4 D4 F#4 A4 D5", "B3 D4 G4 D5 G5", "B3 C4 E4 G4 C5"]     # played 1 2 3 4 5 3 4 5, twice


def tone(midi: int, seconds: float) -> np.ndarray:
    """One struck note of MIDI pitch ``midi``, ``seconds`` long."""
    f = 440.0 * 2 ** ((midi - 69) / 12)
    t = np.arange(int(seconds * RATE)) / RATE
    out = np.zeros_like(t)
    for k in range(1, 12):
        if k * f > RATE / 2.2:
            break
        inharmonic = k * f * np.sqrt(1 + 0.0004 * k * k)
        out += np.sin(2 * np.pi * inharmonic * t) * k ** -1.6 * np.exp(-t * (0.9 + 0.55 * k))
    attack = np.minimum(1.0, t / 0.004)
    return out * attack


def render() -> np.ndarray:
    """The eight bars, a second of decay after them, peak 0.7."""
    bar_len = 16 * SIXTEENTH
    total = int((len(BARS) * bar_len + 2.0) * RATE)
    y = np.zeros(total)
    for b, chord in enumerate(BARS):
        n = chord.split()
        pattern = [n[0], n[1], n[2], n[3], n[4], n[2], n[3], n[4]] * 2
        for i, name in enumerate(pattern):
            start = int((b * bar_len + i * SIXTEENTH) * RATE)
            held = bar_len - i * SIXTEENTH if i in (0, 1, 8, 9) else 4 * SIXTEENTH   # the held bass notes
            x = tone(NOTE[name], held + 1.0) * (0.9 if i in (0, 8) else 0.6)
            y[start:start + len(x)] += x[: total - start]
    y = y / np.abs(y).max() * 0.7
    return y.astype(np.float32)


if __name__ == "__main__":
    sf.write(sys.argv[1], render(), RATE, format="OGG", subtype="VORBIS")
