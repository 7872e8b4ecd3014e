"""The musicnn front end: TF checkpoint reader, the torch port against the original
implementation's taggrams, the continual front end against the batch network, FLOP formulas
against torch's counter, weights errors, the token grid of `extract --frontend musicnn`."""
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from audio import musicnn
from audio.musicnn import mel as musicnn_mel
from audio.errors import MusicnnWeightsError
from audio.musicnn.batch import MusicnnBatch
from audio.musicnn.graph import GraphStream

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_musicnn  # noqa: E402
from tf_checkpoint import TFCheckpointError, crc32c, list_entries, read_checkpoint  # noqa: E402

needs_wheel = pytest.mark.skipif(importlib.util.find_spec("musicnn") is None,
                                 reason="the musicnn 0.1.0 wheel is not installed (pip install --no-deps musicnn==0.1.0)")


@pytest.fixture(scope="module")
def net():
    return musicnn.build_musicnn()[0]


@pytest.fixture(scope="module")
def shared_tokens():
    folder = ROOT.parent / "shared" / "data" / "gtzan_musicnn_tokens"
    if not folder.is_dir():
        pytest.skip(f"shared data not found at {folder}")
    ref = {}
    for f in sorted(folder.glob("*.npz")):
        with np.load(f) as d:
            for tid in np.unique(d["IDS"]):
                ref[str(tid)] = d["X"][d["IDS"] == tid]
    return ref


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283          # the standard CRC-32C check value
    assert crc32c(b"") == 0


@needs_wheel
def test_reader_lists_and_verifies_every_tensor():
    prefix = f"{convert_musicnn.package_dir('MSD_musicnn')}/"
    entries = list_entries(prefix)
    model = {k: e for k, e in entries.items() if "Adam" not in k and "_power" not in k}
    assert len(model) == 64
    tensors = read_checkpoint(prefix, sorted(model))       # raises on any CRC32C mismatch
    trainable = sum(v.size for k, v in tensors.items() if "moving_" not in k)
    assert trainable == 787_159
    assert tensors["conv2d/kernel"].shape == (7, 38, 1, 204)
    assert tensors["dense/kernel"].shape == (1506, 200) and tensors["dense/kernel"].dtype == np.float32


@needs_wheel
def test_a_corrupt_tf_checkpoint_is_refused_by_the_converter(tmp_path):
    src = convert_musicnn.package_dir("MSD_musicnn")
    bad = tmp_path / "MSD_musicnn"
    shutil.copytree(src, bad)
    data = bytearray((bad / ".data-00000-of-00001").read_bytes())
    entry = list_entries(f"{bad}/")["dense/kernel"]
    data[entry["offset"] + entry["size"] // 2] ^= 0xFF                  # one weight of the model
    (bad / ".data-00000-of-00001").write_bytes(bytes(data))
    with pytest.raises(TFCheckpointError, match="CRC32C mismatch"):
        convert_musicnn.convert(bad)


@needs_wheel
def test_the_shipped_weights_equal_a_fresh_conversion_of_the_wheel(tmp_path):
    fresh = convert_musicnn.write("MSD_musicnn", tmp_path / "fresh.safetensors")
    shipped = musicnn.weights_file("MSD_musicnn")
    from safetensors import safe_open
    from safetensors.numpy import load_file
    sd, again = load_file(str(shipped)), load_file(str(fresh))
    assert list(sd) == list(again)                          # the same tensors, bit for bit
    for k in sd:
        assert sd[k].dtype == again[k].dtype == np.float32 and sd[k].shape == again[k].shape
        assert sd[k].tobytes() == again[k].tobytes(), k
    with safe_open(str(shipped), "np") as a, safe_open(str(fresh), "np") as b:
        assert a.metadata() == b.metadata()                 # source, weights' and tensors' sha256
    tf = read_checkpoint(f"{convert_musicnn.package_dir('MSD_musicnn')}/")
    assert len(sd) == 64 and sum(v.size for k, v in sd.items() if not k.endswith((".mean", ".var"))) == 787_159
    np.testing.assert_array_equal(sd["dense.weight"], tf["dense/kernel"].T)   # the tensors, as trained
    assert (ROOT / "assets" / "musicnn" / "LICENSE.md").read_text().startswith("Copyright (c) Music Technology Group")


def test_shipped_weights_that_are_missing_corrupt_or_wrong_are_refused_with_what_to_do(tmp_path, monkeypatch):
    good = musicnn.weights_file("MSD_musicnn").read_bytes()
    monkeypatch.setattr(musicnn, "WEIGHTS_DIR", tmp_path)
    path = tmp_path / "MSD_musicnn.safetensors"
    with pytest.raises(MusicnnWeightsError, match="missing.*git checkout assets/musicnn"):
        musicnn.load_weights()
    bad = bytearray(good)
    bad[-1000] ^= 0xFF                                        # one weight (the tensors are last)
    path.write_bytes(bytes(bad))
    with pytest.raises(MusicnnWeightsError, match="corrupt"):
        musicnn.load_weights()
    path.write_bytes(good[:len(good) // 2])                   # truncated
    with pytest.raises(MusicnnWeightsError, match="unreadable"):
        musicnn.load_weights()
    path.write_bytes(b"not safetensors")
    with pytest.raises(MusicnnWeightsError, match="unreadable"):
        musicnn.load_weights()
    with pytest.raises(MusicnnWeightsError, match="unknown musicnn model 'MTT_vgg'"):
        musicnn.load_weights("MTT_vgg")


def test_the_default_front_end_starts_without_the_musicnn_package():
    """`pip install -e .` alone runs the app: the musicnn package is never imported or read; nor
    are librosa and scipy (1.5 s of imports) on the way to the first hop."""
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] in ('musicnn', 'tf_checkpoint', 'librosa', 'scipy'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from audio.frontends import build_frontend\n"
            "fe = build_frontend('musicnn')\n"
            "print(fe.description, fe.checksum)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["musicnn", "MSD_musicnn", "(pretrained,", "continual)", musicnn.load_weights()[1]]


def test_flop_formulas_equal_torch_flop_counter(net):
    x = torch.randn(2, musicnn.PATCH_FRAMES, musicnn.BANDS)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(x)
    assert counter.get_total_flops() == 2 * 2 * musicnn.patch_macs()
    frames = np.random.default_rng(0).random((16, 96), dtype=np.float32) * 3
    for accumulate in (True, False):                           # CUDA's default form, the CPU's
        batch = MusicnnBatch(net, 1, accumulate=accumulate)
        batch.reset(0)
        batch.push([0], [frames])
        with FlopCounterMode(display=False) as counter:
            batch.push([0], [frames])
        assert counter.get_total_flops() == 2 * batch.macs[0]
        assert musicnn.patch_macs() / batch.macs[0] > 4.0      # ~1,398 M vs ~208-298 M MACs


def raw_patch(history: list[np.ndarray]) -> torch.Tensor:
    frames = np.concatenate([np.zeros((musicnn.PATCH_FRAMES, 96), np.float32)] + history)
    return torch.from_numpy(frames[-musicnn.PATCH_FRAMES:])[None]


def test_continual_front_end_equals_the_batch_network_every_hop(net, shared_data):
    """Every hop of a real track, plus pushes of 0, 1, 2 and 200 frames: the taggram of one CPU
    stream's push (GraphStream) and of a batch of one keeping accumulators (CUDA's default form)
    equals Musicnn on the same 187 frames (silence before the stream starts)."""
    import soundfile as sf
    x, rate = sf.read(shared_data / "gtzan_full_track" / "country.00000.wav", dtype="float32")
    y = musicnn_mel.resample_kaiser_best(x, rate)
    mel, history = musicnn_mel.StreamingMel(), []
    graph, batch = GraphStream(net), MusicnnBatch(net, 1, accumulate=True)
    batch.reset(0)
    chunks = [y[i:i + 4000] for i in range(0, 4000 * 44, 4000)]
    pushes = [mel.push(c) for c in chunks]
    pushes[20:20] = [pushes[20][:0], pushes[20][:1], pushes[20][:2]]
    pushes.append(np.concatenate(pushes[25:40])[:200])
    worst = 0.0
    with torch.no_grad():
        for frames in pushes:
            history.append(frames)
            want = net(raw_patch(history))[0]
            for got in (graph.push(frames), batch.push([0], [frames])[0]):
                worst = max(worst, float((got - want).abs().max()))
    assert worst < 1e-5


def test_one_stream_of_the_front_end_continual_or_recomputed_gives_the_same_tokens():
    """``MusicnnFrontEnd.stream()``: continual on the CPU, the push as one graph (with its own
    log-mel on the host); recomputed, the one slot of the batch's slots (the reference network on
    the patch, the log-mel computed as for many streams; the engine's batch of one is that same
    slot, bit for bit). Over the demo signal's first 14 hops (a full patch and more) their tokens
    agree within the continual test's bound above, their log-mels within a float32 unit at the
    values' scale (<= 4: 2^-21, bound 1e-5; the two log-mels differ only where two FFTs straddle a
    rounding, test_the_log_mel_of_many_streams_on_a_torch_device_is_the_hosts), and the
    recomputed one's FLOPs are the network's on a patch."""
    from audio.frontends import build_frontend
    from audio.sources import DemoSource
    hops = [h for _, h in zip(range(14), DemoSource(seed=3))]
    fronts = [build_frontend("musicnn", continual=c) for c in (True, False)]
    continual, recomputed = (fe.stream() for fe in fronts)
    slots = fronts[1].batch(1)                                   # the engine's one recomputed stream
    slot = slots.join()
    for hop in hops:
        a, b = continual.push(hop), recomputed.push(hop)
        assert torch.equal(slots.push([slot], [hop]).tokens, b.token)
        assert a.token.shape == b.token.shape == (1, musicnn.TAGS)
        assert float((a.token - b.token).abs().max()) < 1e-5
        assert b.flops == 2 * musicnn.patch_macs() > 4 * a.flops
        np.testing.assert_allclose(a.mel, b.mel, rtol=0, atol=1e-5)


def test_the_mel_basis_is_librosas_bit_for_bit():
    """The Slaney filterbank computed here is the one the original took from librosa."""
    librosa = pytest.importorskip("librosa")
    want = librosa.filters.mel(sr=16000, n_fft=512, n_mels=96).astype(np.float32).T
    got = musicnn_mel.mel_basis()
    assert got.dtype == np.float32 and got.shape == (257, 96)
    np.testing.assert_array_equal(got, want)


def test_streaming_mel_equals_the_offline_log_mel():
    rng = np.random.default_rng(1)
    y = (rng.standard_normal(16000 * 3) * 0.1).astype(np.float32)
    mel = musicnn_mel.StreamingMel()
    streamed = np.concatenate([mel.push(y[i:i + 4000]) for i in range(0, len(y), 4000)])
    offline = musicnn_mel.log_mel(y)
    assert len(streamed) == 16000 * 3 // 256                            # floor(15.625 per hop)
    np.testing.assert_array_equal(streamed, offline[:len(streamed)])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_the_log_mel_of_many_streams_on_a_torch_device_is_the_hosts(device):
    """log_mel_of_frames_torch (the many-stream front end's, every stream's frames in one call)
    against the host's log_mel_of_frames, 2.4 million values of noise from silence to clipping
    and of a tone: each value is computed in float64 and rounded once where the original rounds,
    so the two differ only where two libraries' float64 FFTs or products straddle a float32
    rounding boundary, about 2^-28 of the values (0.01 expected here). A float32 mel product or
    magnitude, summed or rounded differently on the two sides, moved 34 and 49 values here."""
    rng = np.random.default_rng(7)
    t = np.arange(4096 * 512) / 16000
    signals = [rng.standard_normal(4096 * 512) * scale for scale in (0.0, 1e-4, 0.05, 0.5)]
    signals.append(np.clip(3 * rng.standard_normal(4096 * 512), -1, 1))
    signals.append(0.3 * np.sin(2 * np.pi * 440 * t))
    mismatched = 0
    for y in signals:
        frames = y.astype(np.float32).reshape(-1, 512)
        want = musicnn_mel.log_mel_of_frames(frames)
        got = musicnn_mel.log_mel_of_frames_torch(torch.from_numpy(frames).to(device)).cpu().numpy()
        assert got.shape == want.shape == (4096, 96)
        mismatched += int((got != want).sum())
    assert mismatched <= 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_many_streams_framed_at_once_are_each_streams_own_frames_bit_for_bit(device):
    """SlotFrames (the many-stream front end's framing, one gather for every stream) against
    each stream's own StreamingMel: streams joining at different hops and a slot taken over,
    hops of 4,000 samples and of odd lengths (3,999, 600, 257, 1 and 0: some complete no frame,
    some several), all in one call; the same samples, so the same bits. A first hop too short
    for the reflect padding is refused as StreamingMel refuses it."""
    rng = np.random.default_rng(1)
    framing, singles, seen = musicnn_mel.SlotFrames(5, device), {}, set()
    for hop in range(12):
        if hop in (0, 2, 5):
            slot = min(set(range(5)) - set(singles))
            framing.reset(slot)
            singles[slot] = musicnn_mel.StreamingMel()
        if hop == 8:                                     # slot 0 left, a new stream takes it
            framing.reset(0)
            singles[0] = musicnn_mel.StreamingMel()
        slots = sorted(singles)
        sizes = [[4000, 4000, 3999, 300, 257, 4000, 1, 0, 600][(hop + s) % 9] for s in slots]
        sizes = [n if framing.started[s] else max(n, 257) for s, n in zip(slots, sizes)]
        hops = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        frames, counts = framing.frames(slots, hops)
        want = [singles[s].frames(h) for s, h in zip(slots, hops)]
        assert counts.tolist() == [len(w) for w in want]
        assert frames.cpu().numpy().tobytes() == np.concatenate(want).tobytes(), hop
        seen.update(counts.tolist())
    assert {0, 1, 2, 15, 16} <= seen
    framing.reset(1)
    with pytest.raises(ValueError, match="reflect padding"):
        framing.frames([1], [np.zeros(256, np.float32)])


def matched_excerpts(shared_data, shared_tokens):
    out = []
    for p in sorted((shared_data / "gtzan_excerpts").glob("*.wav")):
        tid = f"{p.stem.split('.')[0]}/{p.stem}.au"
        if tid in shared_tokens:
            out.append((p, shared_tokens[tid]))
    return out


def test_port_reproduces_the_original_taggrams(net, shared_tokens, shared_data):
    """The 42 shared GTZAN excerpts whose tracks are in the musicnn token files: resampled,
    log-mel'd and cut on the original grid, the first, a middle and the last patch that lies
    inside the excerpt (the last one sees the excerpt's cut) equal the original implementation's
    taggrams within 1e-4 (the issue's bound; observed 3.8e-6)."""
    import soundfile as sf
    matched = matched_excerpts(shared_data, shared_tokens)
    assert len(matched) == 42
    worst = 0.0
    for path, ref in matched:
        x, rate = sf.read(str(path), dtype="float32")
        patches = musicnn_mel.offline_patches(musicnn_mel.resample_kaiser_best(x, rate))
        inside = len(patches) - 1
        assert inside >= 12
        pick = [0, inside // 2, inside - 1]
        with torch.no_grad():
            got = net(torch.from_numpy(patches[pick])).numpy()
        worst = max(worst, float(np.abs(got - ref[pick]).max()))
    assert worst < 1e-4


def test_extract_musicnn_rebuilds_the_token_files_grid(shared_tokens, shared_data, tmp_path):
    """`extract --gtzan DIR --frontend musicnn` on real excerpts: one token per original patch,
    equal to the shared tokens inside the excerpt; the token file records the front end."""
    import subprocess
    import sys

    from audio.tokens.cache import load_tokens
    folder = tmp_path / "gtzan"
    folder.mkdir()
    chosen = matched_excerpts(shared_data, shared_tokens)[::14]                  # 3 genres
    for path, _ in chosen:
        (folder / path.name).symlink_to(path)
    out = tmp_path / "t.npz"
    r = subprocess.run([sys.executable, str(ROOT / "main.py"), "extract", "--gtzan", str(folder),
                        "--frontend", "musicnn", "--out", str(out)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    tokens = load_tokens(out)
    assert tokens.metadata["frontend_info"]["name"] == "musicnn"
    assert tokens.metadata["frontend_info"]["spacing_hops"] == 4
    for (path, ref), x, n in zip(chosen, tokens.X, tokens.lengths):
        inside = int(n) - 1
        assert np.abs(x[:inside] - ref[:inside]).max() < 1e-4


def test_missing_resampy_filter_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("NYSTREAM_KAISER_BEST", str(tmp_path / "none.npz"))
    with pytest.raises(MusicnnWeightsError, match="resampy 0.2.2"):
        musicnn_mel.resample_kaiser_best(np.zeros(22050, np.float32), 22050)
