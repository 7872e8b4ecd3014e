"""File and demo sources on generated audio of many formats, and every bad input."""
import numpy as np
import pytest

from audio.errors import AudioFileError
from audio.melspec import HOP
from audio.decoding import decode_file
from audio.sources import DemoSource, FileSource
from audio_helpers import dominant_frequency, tone, write


@pytest.mark.parametrize("fmt,subtype,rate,channels", [
    ("wav", "PCM_16", 8000, 1), ("wav", "FLOAT", 44100, 2), ("wav", "PCM_24", 48000, 1),
    ("flac", "PCM_16", 22050, 2), ("ogg", "VORBIS", 32000, 1), ("wav", "PCM_16", 96000, 1),
    ("wav", "PCM_16", 16000, 6),
])
def test_formats_rates_and_channels_decode_to_16k_mono(tmp_path, fmt, subtype, rate, channels):
    path = write(tmp_path / f"x.{fmt}", tone(2.0, rate, 440.0, channels), rate, subtype)
    signal, info = decode_file(path)
    assert info["input_rate"] == rate and info["channels"] == channels
    assert signal.dtype == np.float32 and signal.ndim == 1
    assert abs(len(signal) - 32000) <= 32
    assert abs(dominant_frequency(signal[4000:28000]) - 440.0) < 3.0


def test_file_source_hops_and_realtime_pacing(tmp_path):
    import time
    path = write(tmp_path / "t.wav", tone(1.1, 16000), 16000)
    hops = list(FileSource(path))
    assert len(hops) == 4 and all(h.shape == (HOP,) and h.dtype == np.float32 for h in hops)
    t0 = time.monotonic()
    assert len(list(FileSource(path, realtime=True))) == 4
    assert 0.95 <= time.monotonic() - t0 <= 1.5
    looped = FileSource(path, loop=True)
    it = iter(looped)
    assert len([next(it) for _ in range(10)]) == 10
    looped.close()


def test_a_speed_paces_the_sources_clock_and_changes_at_the_next_hop(tmp_path):
    """At speed x a hop is due 0.25 s / x after the one before (on the source's own clock, so
    exactly, however busy the host); a speed set while it plays holds from the next hop; a
    speed the window does not offer is refused in one line."""
    path = write(tmp_path / "t.wav", tone(3.0, 16000), 16000)
    for source in (FileSource(path, realtime=True, speed=4.0), DemoSource(realtime=True, seconds=3, speed=4.0)):
        ready = []
        for i, _ in enumerate(source):
            ready.append(source.last_ready)
            if i == 3:
                source.speed = 8.0
        assert len(ready) + source.stats.dropped == 12
        # whole periods (more than one where a stalled host made the source drop a hop)
        periods = np.diff(ready) / np.array([0.0625] * 3 + [0.03125] * (len(ready) - 4))
        np.testing.assert_allclose(periods, np.maximum(1, np.round(periods)), atol=1e-6)
        assert round(periods.sum()) - len(periods) <= source.stats.dropped     # (one may precede the first)
    for bad in (0.0, -1.0, 3.0, float("nan"), 1e9):
        with pytest.raises(ValueError, match="playback speed is one of 0.5, 1, 2, 4, 8"):
            FileSource(path, speed=bad)


def test_audio_time_is_the_streams_own_when_hops_are_dropped(tmp_path):
    """A real-time file source whose consumer stalls for 2 s drops hops (the sound card's
    overrun); each token's audio time counts them, so the last one is the file's length."""
    import time
    from audio.frontends import build_frontend
    from audio.tokens.stream import TokenStream
    path = write(tmp_path / "t.wav", tone(3.0, 16000), 16000)
    source = FileSource(path, realtime=True)
    times = []
    for item in TokenStream(source, build_frontend("musicnn")):
        times.append((item.index, item.audio_time))
        if item.index == 1:
            time.sleep(2.0)
    dropped = source.stats.dropped
    assert dropped >= 3 and len(times) == 12 - dropped
    assert times[-1][1] == 3.0                                  # every hop of the file accounted for
    assert [t for _, t in times[:2]] == [0.25, 0.5]
    assert all(b > a for (_, a), (_, b) in zip(times, times[1:]))


def test_missing_file(tmp_path):
    with pytest.raises(AudioFileError, match="not found"):
        decode_file(tmp_path / "nope.wav")


def test_empty_file(tmp_path):
    (tmp_path / "empty.wav").write_bytes(b"")
    with pytest.raises(AudioFileError, match="empty"):
        decode_file(tmp_path / "empty.wav")


def test_header_only_wav_has_no_audio(tmp_path):
    path = write(tmp_path / "zero.wav", np.zeros(0), 16000)
    with pytest.raises(AudioFileError):
        decode_file(path)


def test_non_audio_file(tmp_path):
    (tmp_path / "notes.wav").write_text("these are not samples\n" * 50)
    with pytest.raises(AudioFileError, match="cannot decode"):
        decode_file(tmp_path / "notes.wav")


def test_truncated_file_gives_what_it_holds(tmp_path):
    """A WAV cut mid-data (like GTZAN's jazz.00054) decodes the samples that exist."""
    path = write(tmp_path / "full.wav", tone(2.0, 16000), 16000, "PCM_16")
    data = path.read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(data[: len(data) // 2 + 1])     # odd length: a torn final sample
    signal, _ = decode_file(cut)
    assert 15000 < len(signal) < 17000 and np.isfinite(signal).all()


def test_garbage_after_a_valid_header(tmp_path):
    path = write(tmp_path / "full.wav", tone(1.0, 16000), 16000, "PCM_16")
    data = bytearray(path.read_bytes())
    data[8:12] = b"XXXX"                               # break the RIFF/WAVE tag
    bad = tmp_path / "bad.wav"
    bad.write_bytes(bytes(data))
    with pytest.raises(AudioFileError):
        decode_file(bad)


def test_shorter_than_one_hop_gives_one_padded_hop(tmp_path):
    path = write(tmp_path / "short.wav", tone(0.1, 16000), 16000)
    hops = list(FileSource(path))
    assert len(hops) == 1 and hops[0].shape == (HOP,)
    assert np.all(hops[0][1600:] == 0)


def test_nan_inf_samples_are_zeroed_and_counted(tmp_path):
    x = tone(1.0, 16000).astype(np.float32)
    x[100:110] = np.nan
    x[500] = np.inf
    path = write(tmp_path / "nan.wav", x, 16000, "FLOAT")
    source = FileSource(path)
    assert all(np.isfinite(h).all() for h in source)          # counted as the file is read
    assert source.stats.nonfinite == 11


def test_clipping_is_clamped_and_counted(tmp_path):
    x = tone(1.0, 16000, amp=2.0).astype(np.float32)
    path = write(tmp_path / "loud.wav", x, 16000, "FLOAT")
    source = FileSource(path)
    assert max(np.abs(h).max() for h in source) <= 1.0
    assert source.stats.clipped > 1000


def test_demo_signal_is_deterministic_music():
    a = [h for _, h in zip(range(12), DemoSource(seed=0))]
    b = [h for _, h in zip(range(12), DemoSource(seed=0))]
    c = [h for _, h in zip(range(12), DemoSource(seed=1))]
    np.testing.assert_array_equal(np.concatenate(a), np.concatenate(b))
    assert not np.array_equal(np.concatenate(a), np.concatenate(c))
    x = np.concatenate(a)
    assert 0.02 < np.sqrt(np.mean(x ** 2)) < 0.5 and np.abs(x).max() <= 1.0
    assert len(list(DemoSource(seconds=2.0))) == 8


def test_demo_hops_are_the_pieces_formula_with_each_seeds_noise():
    """Every hop, with hi-hat or without, at hop starts and elsewhere, where a seed's noise
    wraps around the shared table too, is bit for bit the piece's formula: chords and bass plus
    the off-beat hi-hat (0.05 x its decay times the noise table of seed 0 read from the
    stream's own offset, seed x 104,729 + sample, cyclically), clipped; quiet hops (no hi-hat)
    are the same for every seed."""
    from audio.sources import NOISE_SAMPLES, NOISE_STRIDE, _demo_tonal
    table = np.random.default_rng(0).standard_normal(NOISE_SAMPLES)
    wrap = NOISE_SAMPLES - (5 * NOISE_STRIDE) % NOISE_SAMPLES - 100      # seed 5's noise wraps here
    quiet = 0
    for start in [t * HOP for t in range(16)] + [1234, 3 * HOP + 17, wrap]:
        t = np.arange(start, start + HOP) / 16000
        tonal = _demo_tonal(start, HOP)[0]
        off_beat = (t % 0.5) >= 0.25
        index = (5 * NOISE_STRIDE + start + np.arange(HOP)) % NOISE_SAMPLES
        hat = np.where(off_beat, 0.05 * np.exp(-30 * ((t % 0.25) / 0.5)), 0.0)
        want = np.clip(tonal + table[index] * hat, -1, 1).astype(np.float32)
        assert DemoSource(seed=5).render(start, HOP).tobytes() == want.tobytes(), start
        if not off_beat.any():
            quiet += 1
            assert DemoSource(seed=9).render(start, HOP).tobytes() == want.tobytes()
    assert quiet == 8


def test_missing_portaudio_is_a_typed_error_and_files_still_work(monkeypatch, tmp_path):
    import builtins
    import sys

    from audio.errors import AudioDeviceError
    from audio.sources import MicrophoneSource
    real_import = builtins.__import__

    def no_portaudio(name, *args, **kwargs):
        if name == "sounddevice":
            raise OSError("PortAudio library not found")
        return real_import(name, *args, **kwargs)
    monkeypatch.delitem(sys.modules, "sounddevice", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_portaudio)
    with pytest.raises(AudioDeviceError, match="libportaudio2"):
        MicrophoneSource()
    path = write(tmp_path / "ok.wav", tone(0.5, 16000), 16000)
    assert len(list(FileSource(path))) == 2
