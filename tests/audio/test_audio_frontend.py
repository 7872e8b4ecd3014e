"""Log-mel front end: exact against torchvggish, streaming equal to offline, token timing."""
import numpy as np
import pytest
import torch

from audio.melspec import HOP, PAD, StreamingLogMel, log_mel_frames, num_tokens, offline_patches
from audio.decoding import decode_file
from audio.sources import FileSource
from audio.tokens.stream import TokenStream
from audio.tokens import tokens_for_file, tokens_for_signal
from audio.vggish import build_embedder
from audio_helpers import tone, write


def test_frames_match_torchvggish_waveform_to_examples():
    from torchvggish.vggish_input import waveform_to_examples
    rng = np.random.default_rng(0)
    x = np.concatenate([np.zeros(PAD), 0.3 * rng.standard_normal(16000 * 4 + 777)])
    theirs = waveform_to_examples(x, 16000, return_tensor=False).reshape(-1, 64)
    ours = log_mel_frames(x)[: len(theirs)]
    assert np.abs(ours - theirs).max() <= 1e-4


def test_token_t_covers_the_audio_ending_at_its_hop():
    """A click at sample s appears first in token floor(s / HOP) and in no earlier token."""
    x = np.zeros(HOP * 12)
    s = HOP * 7 + 1234
    x[s] = 1.0
    patches = offline_patches(x)
    silent = offline_patches(np.zeros(HOP * 12))
    touched = [t for t in range(12) if np.abs(patches[t] - silent[t]).max() > 1e-6]
    assert touched[0] == 7
    assert touched[-1] <= 7 + 3                    # 0.96 s later it has left the patch


@pytest.mark.parametrize("samples", [HOP * 10, HOP * 10 + 1, HOP * 10 + HOP - 1, 1000])
def test_streaming_patches_equal_offline(samples):
    rng = np.random.default_rng(samples)
    x = 0.2 * rng.standard_normal(samples)
    off = offline_patches(x)
    assert len(off) == num_tokens(samples)
    stream = StreamingLogMel()
    for t in range(len(off)):
        hop = x[t * HOP:(t + 1) * HOP]
        hop = np.pad(hop, (0, HOP - len(hop)))
        np.testing.assert_array_equal(stream.push(hop), off[t])


def test_num_tokens_rule():
    assert num_tokens(0) == 0
    assert num_tokens(1) == 1                     # shorter than a hop: one zero-padded token
    assert num_tokens(HOP * 120 + 3000) == 120    # trailing partial hop is not classified
    with pytest.raises(ValueError, match="4000"):
        StreamingLogMel().push(np.zeros(100))


@pytest.fixture(scope="module")
def embedder():
    return build_embedder(random_seed=0)


def test_streaming_tokens_equal_offline_tokens(tmp_path, embedder):
    path = write(tmp_path / "odd.wav", tone(3.3, 22050, 330.0) + tone(3.3, 22050, 1250.0, amp=0.2), 22050)
    offline, _ = tokens_for_file(path, embedder)
    streamed = torch.cat([item.token for item in TokenStream(FileSource(path), embedder)])
    assert offline.shape == streamed.shape == (13, 128)
    assert (offline - streamed).abs().max() <= 1e-5 * max(1.0, offline.abs().max().item())


def test_gtzan_track_gives_120_tokens_streaming_equals_offline(shared_data, embedder):
    path = shared_data / "gtzan_full_track" / "country.00000.wav"
    offline, info = tokens_for_file(path, embedder)
    assert offline.shape == (120, 128) and info["input_rate"] == 22050
    source = FileSource(path)
    stream = StreamingLogMel()
    patches = np.stack([stream.push(hop) for hop in source])
    streamed = torch.cat([embedder(patches[i:i + 1]) for i in range(0, 120, 9)])   # every 9th
    assert (offline[::9] - streamed).abs().max() <= 1e-5 * max(1.0, offline.abs().max().item())
    np.testing.assert_array_equal(patches, offline_patches(decode_file(path)[0]))   # streamed decode = whole


def test_real_music_excerpts_decode_and_embed(shared_data, embedder):
    for path in sorted((shared_data / "gtzan_excerpts").glob("*.0000[01].wav"))[:6]:
        tokens, info = tokens_for_file(path, embedder)
        assert 60 <= len(tokens) <= 80 and torch.isfinite(tokens).all(), path
    for path in sorted((shared_data / "cc_music").glob("*.ogg"))[:1]:
        tokens, info = tokens_for_file(path, embedder)
        assert len(tokens) > 0 and torch.isfinite(tokens).all()


def test_silence_gives_finite_constant_tokens(embedder):
    tokens = tokens_for_signal(np.zeros(HOP * 8, dtype=np.float32), embedder)
    assert torch.isfinite(tokens).all()
    assert (tokens - tokens[0]).abs().max() < 1e-5
