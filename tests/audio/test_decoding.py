"""Streamed decoding: block by block, one stateful resampler. Oracles: soundfile's whole-file
read, the same conditioning and soxr's one-shot resampling (bit-identical), and the peak
resident memory of a fresh process reading a long file (it must not grow with the file)."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import soundfile as sf
import soxr

from audio.decoding import BLOCK_SECONDS, SourceStats, condition, decode_file, probe, stream
from audio.errors import AudioFileError
from audio.melspec import HOP, SAMPLE_RATE
from audio.sources import FileSource


def music(seconds, rate, channels, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t)[:, None] + 0.05 * rng.standard_normal((len(t), channels))
    return x.astype(np.float32)


def whole_file_oracle(path):
    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = condition(data, SourceStats())
    return soxr.resample(mono, rate, SAMPLE_RATE) if rate != SAMPLE_RATE else mono


@pytest.mark.parametrize("rate,channels,fmt", [(44100, 2, "wav"), (22050, 1, "wav"), (16000, 1, "flac"),
                                               (48000, 2, "ogg")])
def test_streamed_decode_equals_the_whole_file_resampled_at_once(tmp_path, rate, channels, fmt):
    path = tmp_path / f"x.{fmt}"
    x = music(3 * BLOCK_SECONDS + 0.37, rate, channels)
    if fmt == "wav":
        x[1000:1003] = np.nan                                     # float WAV keeps them
    sf.write(str(path), x, rate, subtype="FLOAT" if fmt == "wav" else None)
    oracle = whole_file_oracle(path)
    stats = SourceStats()
    chunks = list(stream(probe(path), stats))
    assert len(chunks) >= 3                                       # it did stream
    np.testing.assert_array_equal(np.concatenate(chunks), oracle)
    assert probe(path).samples == len(oracle)
    assert stats.nonfinite == (3 if fmt == "wav" else 0)
    np.testing.assert_array_equal(decode_file(path)[0], oracle)
    hops = list(FileSource(path))
    assert len(hops) == len(oracle) // HOP == FileSource(path).hops()
    np.testing.assert_array_equal(np.concatenate(hops), oracle[:len(hops) * HOP])


def test_a_file_cut_short_after_its_header_is_named(tmp_path):
    path = tmp_path / "cut.flac"
    sf.write(str(path), music(8, 16000, 1), 16000)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    try:
        hops = list(FileSource(path))                            # soundfile may stop cleanly ...
        assert 0 < len(hops) < 32
    except AudioFileError as e:                                  # ... or report the damage
        assert str(path) in str(e) and "\n" not in str(e)


def peak_rss_growth_mb(path, hops=None) -> float:
    """Peak resident memory (MB) a fresh process adds while taking hops of ``path``."""
    code = textwrap.dedent(f"""
        import resource
        from audio.sources import FileSource
        import audio.decoding, soundfile, soxr                   # imported before the baseline
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        source = FileSource({str(path)!r})
        for i, hop in enumerate(source):
            if {hops!r} is not None and i + 1 >= {hops!r}:
                break
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def test_memory_does_not_grow_with_the_file(tmp_path):
    """Ten minutes of 44.1 kHz stereo: whole, it decodes to 106 MB of float32 samples (and
    ~5x that at the peak, before this change); streamed, reading it adds a few MB."""
    path = tmp_path / "long.wav"
    with sf.SoundFile(str(path), "w", 44100, 2, subtype="PCM_16") as f:
        block = music(10, 44100, 2)
        for _ in range(60):
            f.write(block)
    assert peak_rss_growth_mb(path) < 30
