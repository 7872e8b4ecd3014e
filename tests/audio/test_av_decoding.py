"""What soundfile cannot read, through PyAV (FFmpeg's decoders in its wheels): AAC in M4A and
ADTS, Opus in WebM, six channels in MP4, the audio track of a video. Oracles: the file decoded
whole by PyAV itself, conditioned and resampled by soxr in one shot (the streamed decode equals it
bit for bit); the tone that was encoded (its frequency, and its level within the codec's error);
the records of the same samples written to a float WAV (identical); the peak resident memory of
a fresh process reading ten minutes. Hostile files: cut short, lying about their length,
garbage under an audio name, a video without sound."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

av = pytest.importorskip("av")

from audio.decoding import SourceStats, condition, decode_file, probe, stream  # noqa: E402
from audio.errors import AudioFileError  # noqa: E402
from audio.melspec import HOP, SAMPLE_RATE  # noqa: E402
from audio.sources import FileSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {1: "mono", 2: "stereo", 3: "3.0", 6: "5.1"}


def encode(path: Path, fmt: str, codec: str, rate: int, channels: int, seconds: float, video: bool = False,
           tone: float = 440.0) -> Path:
    """A tone of amplitude 0.3 on every channel, encoded by FFmpeg (with a few frames of video
    before it when asked)."""
    with av.open(str(path), "w", format=fmt) as c:
        picture = None
        if video:
            picture = c.add_stream("mpeg4", rate=10)
            picture.width, picture.height, picture.pix_fmt = 64, 48, "yuv420p"
        s = c.add_stream(codec, rate=rate, layout=LAYOUTS[channels])
        if picture is not None:
            for i in range(int(seconds * 10)):
                frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 40 * (i % 6), np.uint8), format="rgb24")
                for p in picture.encode(frame):
                    c.mux(p)
            for p in picture.encode(None):
                c.mux(p)
        t = np.arange(int(seconds * rate)) / rate
        x = np.tile((0.3 * np.sin(2 * np.pi * tone * t)).astype(np.float32), (channels, 1))
        frame = av.AudioFrame.from_ndarray(x, format="fltp", layout=LAYOUTS[channels])
        frame.sample_rate = rate
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return path


def whole_by_pyav(path: Path) -> np.ndarray:
    """Every sample of the first audio track, decoded in one go, conditioned, resampled once."""
    with av.open(str(path)) as c:
        track = next(s for s in c.streams if s.type == "audio")
        to_float = av.AudioResampler(format="flt", layout=track.codec_context.layout, rate=track.codec_context.sample_rate)
        parts = [f.to_ndarray().reshape(-1, track.codec_context.channels)
                 for frame in c.decode(track) for f in to_float.resample(frame)]
        parts += [f.to_ndarray().reshape(-1, track.codec_context.channels) for f in to_float.resample(None)]
        rate = track.codec_context.sample_rate
    mono = condition(np.concatenate(parts), SourceStats())
    return soxr.resample(mono, rate, SAMPLE_RATE) if rate != SAMPLE_RATE else mono


def dominant_hz(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum) * SAMPLE_RATE / len(x))


@pytest.mark.parametrize("name,fmt,codec,rate,channels,video", [
    ("a.m4a", "ipod", "aac", 44100, 2, False), ("b.aac", "adts", "aac", 48000, 1, False),
    ("c.webm", "webm", "libopus", 48000, 2, False), ("d.mp4", "mp4", "aac", 22050, 6, False),
    ("e.mp4", "mp4", "aac", 32000, 3, True)])
def test_each_format_streams_as_it_decodes_whole_and_is_the_tone_encoded(tmp_path, name, fmt, codec, rate,
                                                                         channels, video):
    """Streamed equals whole, bit for bit; the channels averaged; the 440 Hz tone at its level
    within the codec's error (AAC and Opus at their default bitrates keep a pure tone's level to a
    few per cent; 10 % is the bound, a wrong channel average or rate would miss it by far). In 5.1
    the LFE channel is low-passed (AAC carries it below ~120 Hz): the mean of six is 5/6 of 0.3."""
    path = encode(tmp_path / name, fmt, codec, rate, channels, 5.0, video=video)
    audio = probe(path)
    assert (audio.reader, audio.input_rate, audio.channels) == ("av", rate, channels)
    assert abs(audio.frames / rate - 5.0) < 0.2                       # the container's estimate
    chunks = list(stream(audio, SourceStats()))
    assert len(chunks) >= 2                                           # it did stream (2 s blocks)
    oracle = whole_by_pyav(path)
    np.testing.assert_array_equal(np.concatenate(chunks), oracle)
    np.testing.assert_array_equal(decode_file(path)[0], oracle)
    hops = list(FileSource(path))
    assert len(hops) == len(oracle) // HOP
    middle = oracle[SAMPLE_RATE:4 * SAMPLE_RATE]                      # past the codec's priming
    assert abs(dominant_hz(middle) - 440.0) < 2.0
    level = 0.3 * (5 / 6 if channels == 6 else 1)
    assert abs(np.sqrt(2) * np.sqrt(np.mean(middle ** 2)) - level) < 0.1 * level


def test_classify_reads_an_m4a_as_it_reads_the_same_samples_in_a_wav(tmp_path):
    """`classify song.m4a` gives the records of the same samples written to a float WAV."""
    m4a = encode(tmp_path / "song.m4a", "ipod", "aac", 44100, 2, 3.0, tone=660.0)
    with av.open(str(m4a)) as c:
        track = c.streams.audio[0]
        to_float = av.AudioResampler(format="flt", layout="stereo", rate=44100)
        x = np.concatenate([f.to_ndarray().reshape(-1, 2) for frame in c.decode(track)
                            for f in to_float.resample(frame)] + [f.to_ndarray().reshape(-1, 2)
                                                                  for f in to_float.resample(None)])
    wav = tmp_path / "song.wav"
    sf.write(str(wav), x, 44100, subtype="FLOAT")
    runs = []
    for path in (m4a, wav):
        r = subprocess.run([sys.executable, str(ROOT / "main.py"), "classify", str(path), "--jsonl"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        runs.append([json.loads(line) for line in r.stdout.splitlines()])
    strip = lambda rs: [{k: m["probabilities"] for k, m in x["models"].items()} for x in rs[:-1]]  # noqa: E731
    assert len(runs[0]) == len(runs[1]) > 10 and strip(runs[0]) == strip(runs[1])


def test_ten_minutes_through_pyav_add_a_few_mb(tmp_path):
    """PCM in Matroska (soundfile cannot read it; quick to write): ten minutes of 44.1 kHz stereo
    are 106 MB of float32 samples; streamed, reading them adds a few MB."""
    from test_decoding import peak_rss_growth_mb
    path = tmp_path / "long.mka"
    with av.open(str(path), "w", format="matroska") as c:
        s = c.add_stream("pcm_s16le", rate=44100, layout="stereo")
        block = (0.3 * np.sin(2 * np.pi * 440 * np.arange(441000) / 44100) * 32767).astype(np.int16)
        for _ in range(60):
            frame = av.AudioFrame.from_ndarray(np.repeat(block, 2).reshape(1, -1), format="s16", layout="stereo")
            frame.sample_rate = 44100
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    assert probe(path).reader == "av"
    assert peak_rss_growth_mb(path) < 30


def test_hostile_files_through_pyav_are_one_line_each(tmp_path):
    """An M4A cut short (its index is at the end), ADTS cut mid-frame, garbage named .m4a, a
    video without sound: each refused in one line naming the file, or (the cut ADTS) read to
    where it breaks. A length is never taken from a header to size anything (FFmpeg derives a
    track's from its sample tables); what decodes past the limit read here ends the stream."""
    good = encode(tmp_path / "good.m4a", "ipod", "aac", 44100, 2, 4.0)
    cut = tmp_path / "cut.m4a"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage = tmp_path / "garbage.m4a"
    garbage.write_bytes(b"\x00\x00\x00\x18ftypM4A " + bytes(range(256)) * 40)
    silent = tmp_path / "silent.mp4"
    with av.open(str(silent), "w", format="mp4") as c:
        picture = c.add_stream("mpeg4", rate=10)
        picture.width, picture.height, picture.pix_fmt = 64, 48, "yuv420p"
        for i in range(5):
            for p in picture.encode(av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")):
                c.mux(p)
        for p in picture.encode(None):
            c.mux(p)
    for path, words in ((cut, "cannot decode"), (garbage, "cannot decode"), (silent, "has no audio track")):
        with pytest.raises(AudioFileError) as e:
            list(FileSource(path))
        assert str(path) in str(e.value) and words in str(e.value) and "\n" not in str(e.value), str(e.value)
    adts = encode(tmp_path / "x.aac", "adts", "aac", 48000, 1, 4.0)
    cut_adts = tmp_path / "cut.aac"
    cut_adts.write_bytes(adts.read_bytes()[: adts.stat().st_size * 3 // 4 + 7])
    try:
        hops = list(FileSource(cut_adts))
        assert 0 < len(hops) < 4 * 4                                  # what is there
    except AudioFileError as e:
        assert str(cut_adts) in str(e) and "\n" not in str(e)
    audio = probe(adts)
    audio.max_seconds = 3.0                                           # a 4 s file past a 3 s limit
    with pytest.raises(AudioFileError, match=r"decodes to more than 0.000833333 h of audio, the most read here"):
        list(stream(audio, SourceStats()))
    with pytest.raises(AudioFileError, match=r"declares .* hours of audio, over the"):
        probe(adts, max_seconds=2.0)                                  # its estimate, refused before decoding


def test_an_m4a_replaced_or_written_after_its_check_is_refused_in_one_line(tmp_path):
    """What probe checked is what PyAV reads: a file overwritten after the check, or renamed
    over, ends the stream before any audio of the other file is decoded."""
    path = encode(tmp_path / "a.m4a", "ipod", "aac", 44100, 2, 3.0)
    other = encode(tmp_path / "b.m4a", "ipod", "aac", 22050, 1, 5.0, tone=880.0)
    for replace in (lambda: path.write_bytes(other.read_bytes()), lambda: other.replace(path)):
        audio = probe(path)
        replace()
        with pytest.raises(AudioFileError, match=r"changed since it was checked: it was (modified|replaced)") as e:
            list(stream(audio, SourceStats()))
        assert "\n" not in str(e.value)
        other = encode(tmp_path / "b.m4a", "ipod", "aac", 22050, 1, 5.0, tone=880.0)
