"""The batched continual musicnn front end (audio/musicnn/batch.py): every stream's taggram, at
every hop, equals the original network's in float64 on that stream's own 187 frames, whatever
else is in the batch, whenever the stream joined, whatever number of frames each hop brings;
its multiply-accumulates are what torch's FLOP counter counts in its push, and what the
algorithm's own count says (``push_macs``); a hop that brings no frame costs nothing; a stream's NaN frames
reach no other stream. On CUDA (skipped without it) the same, and a hop never waits for the
device."""
import copy
import math

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from audio import musicnn
from audio.musicnn.batch import MusicnnBatch
from error_model import EPS32

# Error model (tests/error_model.py): the float32 taggram and the float64 network differ by the
# rounding of a chain of STAGES float32 stages (input BN, front-end conv and BN, three mid-end
# convs, two dense layers), each a dot product of at most TERMS terms (the first mid-end conv:
# 7 frames x 561 channels), relative to the logits' scale max(1, |logit|); a sigmoid moves by at
# most a quarter of its logit's change.
STAGES, TERMS = 8, 7 * musicnn.FRONT_CH


def taggram_tol(logits64: torch.Tensor) -> float:
    return STAGES * EPS32 * math.sqrt(TERMS) * max(1.0, logits64.abs().max().item()) / 4


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# (device, accumulate): every temporal branch by accumulators (CUDA's in float32 and bf16),
# the K = 128 one only (CUDA's in TF32), every branch's rows recomputed (the CPU's); on each device
HYBRID = (True, False, False)
MODES = [("cpu", True), ("cpu", HYBRID), ("cpu", False), pytest.param("cuda", True, marks=CUDA),
         pytest.param("cuda", HYBRID, marks=CUDA), pytest.param("cuda", False, marks=CUDA)]


@pytest.fixture(scope="module")
def nets():
    net, _ = musicnn.build_musicnn()
    return net, copy.deepcopy(net).double()


def on(net, device: str):
    return net if device == "cpu" else copy.deepcopy(net).to(device)


def frames(rng, k: int) -> np.ndarray:
    return (rng.random((k, musicnn.BANDS), dtype=np.float32) * 4).astype(np.float32)


def patch_of(history: list[np.ndarray]) -> torch.Tensor:
    """(1, 187, 96) float64: the stream's newest 187 frames, silence (log-mel 0) before it."""
    x = np.concatenate([np.zeros((musicnn.PATCH_FRAMES, musicnn.BANDS), np.float32)] + history)
    return torch.from_numpy(x[-musicnn.PATCH_FRAMES:]).double()[None]


def logits64_of(net64, history: list[np.ndarray]) -> torch.Tensor:
    """(50,) the float64 network's logits on the stream's newest 187 frames."""
    x = net64.normalize(patch_of(history))
    with torch.no_grad():
        return net64.head(torch.cat([net64.timbral_valid(torch.nn.functional.pad(x, (0, 0, 3, 3))),
                                     net64.temporal_same(x)], dim=2))[0]


@pytest.mark.parametrize("device, accumulate", MODES)
def test_streams_joining_at_any_hop_with_any_frame_counts_equal_the_float64_network(nets, device, accumulate, errors):
    net, net64 = nets
    rng = np.random.default_rng(0)
    batch = MusicnnBatch(on(net, device), capacity=4, accumulate=accumulate, chunk=2)   # 3 streams: 2 + 1
    histories: dict[int, list] = {}
    worst, tol = 0.0, float("inf")
    for hop in range(14):
        if hop in (0, 3, 9):                          # streams join at hops 0, 3 and 9 ...
            slot = [s for s in range(4) if s not in histories][0]
            batch.reset(slot)
            histories[slot] = []
        if hop == 11:                                 # ... one leaves at hop 11, another takes its slot
            del histories[0]
            batch.reset(0)
            histories[0] = []
        slots = sorted(histories)
        # 0.25 s hops bring 15 or 16 frames; also none, one, more than the K = 32 and 64 branches'
        # end-edge rows (40), a jump past the temporal kernels, a whole patch
        ks = {s: [15, 16, 40, 0, 1, 80, 16, 200, 15][(hop + s) % 9] for s in slots}
        pushed = [frames(rng, ks[s]) for s in slots]
        with FlopCounterMode(display=False) as counter:
            got = batch.push(slots, pushed).cpu()                                   # (S, 50)
        assert counter.get_total_flops() == 2 * sum(int(batch.macs[s]) for s in slots)   # its own count
        for i, s in enumerate(slots):
            histories[s].append(pushed[i])
            logits64 = logits64_of(net64, histories[s])
            worst = max(worst, (got[i].double() - torch.sigmoid(logits64)).abs().max().item())
            tol = min(tol, taggram_tol(logits64))
            if 0 < ks[s] <= musicnn.PATCH_FRAMES - max(musicnn.TEMPORAL):      # (0: the last taggram again)
                assert batch.macs[s] == push_macs(ks[s], batch.accumulate)
    errors(f"batched musicnn taggrams on {device} (accumulators {batch.accumulate}) "
           f"vs the float64 network", worst, tol)


@pytest.mark.parametrize("conv, padding", [(0, 3), (1, 3), (2, 0)])
def test_each_way_of_a_convolution_is_a_float32_convolution(nets, conv, padding):
    """musicnn.conv1d's three ways (the CPU's im2col product, CUDA's one product per tap with
    cuDNN off, the convolution itself) against the float64 convolution, on the CPU: each output
    is a float32 dot product of C x 7 terms summed in some order, so its error is at most
    (C x 7 + 1) float32 units of the sum of the terms' magnitudes (plus the bias's rounding),
    the classic bound."""
    net = nets[0]
    w, b = net.mid[conv].weight, net.mid[conv].bias
    g = torch.Generator().manual_seed(conv)
    x = torch.randn(5, w.shape[1], 40, generator=g) * 3                       # (B, C, T)
    want = torch.nn.functional.conv1d(x.double(), w.double(), b.double(), padding=padding)
    scale = torch.nn.functional.conv1d(x.double().abs(), w.double().abs(), b.double().abs(), padding=padding)
    bound = (w.shape[1] * w.shape[2] + 2) * EPS32 / 2 * scale
    got = {way: musicnn.conv1d(x, w, b, padding=padding, way=way) for way in ("im2col", "taps", "conv")}
    for way, out in got.items():
        assert out.shape == want.shape
        assert ((out.double() - want).abs() <= bound).all(), way
    assert not torch.equal(got["taps"], got["conv"])                          # another order
    assert torch.equal(musicnn.conv1d(x, w, b, padding=padding), got["im2col"])   # the CPU's default
    with pytest.raises(ValueError, match="way must be"):
        musicnn.conv1d(x, w, way="fft")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_precision_switches_are_set_only_on_cuda_and_given_back(device):
    """musicnn.precision: on the CPU it touches none of torch's process-wide switches (a
    server's lanes push in threads of their own: interleaved settings and restores once left
    cuDNN's conv and RNN flags apart, which torch.export then refused); on CUDA it sets them
    for the network (float32 and bf16: TF32 and cuDNN off; TF32: both on; bf16 products summed in
    float32 in every way) and gives them back."""
    b = torch.backends
    state = lambda: (b.cuda.matmul.fp32_precision, b.cudnn.fp32_precision, b.cudnn.conv.fp32_precision,  # noqa: E731
                     b.cudnn.rnn.fp32_precision, b.cudnn.enabled, b.cudnn.benchmark,
                     b.cuda.matmul.allow_bf16_reduced_precision_reduction)
    before = state()
    for mode in musicnn.PRECISIONS:
        tf32 = mode == "tf32"
        with musicnn.precision(mode, device):
            inside = state()
            assert inside == before if device == "cpu" else inside == (("tf32" if tf32 else "ieee"),) * 4 + (tf32, True, False)
        assert state() == before
    assert isinstance(b.cudnn.allow_tf32, bool)          # the legacy reading still answers


def push_macs(k: int, accumulate: tuple) -> int:
    """The multiply-accumulates of a hop of 1 <= k <= P - 128 frames, counted from the algorithm:
    the head over the patch, less the first mid-end convolution's timbral part of the rows whose
    window holds interior timbral rows only (cached), plus that part for the k rows that became
    such; the timbral rows, the k that became interior and the 3 + 3 edge rows (208 columns);
    per temporal branch with accumulators of its edge rows, the frames leaving the b - k rows
    that stay start-edge rows, the min(k, b) rows that became start-edge rows summed over K - 1
    frames, the k new frames added to the a old end-edge rows, the k new rows' k + b frames;
    per branch without them, the two products of ``_recompute`` (the k + a end rows over
    frames P-k-a-b .. P-1, the b start rows over frames 0 .. K-2, zero taps included)."""
    P, mid_row = musicnn.PATCH_FRAMES, 7 * 2 * musicnn.TIMBRAL_CH * musicnn.MID_CH
    macs = musicnn.head_macs() - (P - 12 - k) * mid_row
    macs += (k + 6) * musicnn.timbral_macs_per_frame(musicnn.TIMBRAL_COLS)
    for K, acc in zip(musicnn.TEMPORAL, accumulate):
        b, a = musicnn.same_padding(K)
        rows = (max(b - k, 0) * k + min(k, b) * (K - 1) + a * k + k * (k + b)) if acc else ((k + a) * (k + a + b) + b * (K - 1))
        macs += rows * musicnn.TEMPORAL_CH * musicnn.BANDS
    return macs


def test_the_features_gathered_as_on_cuda_are_the_per_slot_ones_bit_for_bit(nets):
    """CUDA takes the edge rings' maxima by one gather and adds to them by one scatter for all
    slots, the CPU slot by slot in place: on the CPU both ways, over joins at different hops and every kind of hop, give the
    same taggrams and state, bit for bit (a max is exact)."""
    net = nets[0]
    pair = [MusicnnBatch(net, capacity=3, accumulate=True) for _ in range(2)]
    pair[1].slotwise = False
    rng = np.random.default_rng(3)
    for hop in range(12):
        for batch in pair:
            if hop in (0, 4):
                batch.reset(hop // 4)
        slots = [0] if hop < 4 else [0, 1]
        ks = [[16, 15, 40, 1, 80][(hop + s * (hop % 2)) % 5] for s in slots]    # odd hops: k per stream
        pushed = [frames(rng, k) for k in ks]
        assert torch.equal(*(batch.push(slots, pushed) for batch in pair))
    assert all(torch.equal(pair[0].state[name], pair[1].state[name]) for name in pair[0].state)


@pytest.mark.parametrize("device, accumulate", MODES)
def test_a_streams_nan_frames_reach_no_other_stream(nets, device, accumulate):
    net = on(nets[0], device)
    rng = np.random.default_rng(1)
    runs = []
    for poison in (False, True):
        batch = MusicnnBatch(net, capacity=3, accumulate=accumulate)
        for s in range(3):
            batch.reset(s)
        rng = np.random.default_rng(1)
        out = []
        for hop in range(4):
            pushed = [frames(rng, 16) for _ in range(3)]
            if poison and hop == 1:
                pushed[1][5, 7] = np.nan
            out.append(batch.push([0, 1, 2], pushed).cpu())
        runs.append(torch.stack(out))                                               # (hops, 3, 50)
    clean, poisoned = runs
    assert torch.isnan(poisoned[1:, 1]).all()
    assert torch.equal(clean[:, [0, 2]], poisoned[:, [0, 2]])                      # bit for bit


@CUDA
@pytest.mark.parametrize("accumulate", [True, HYBRID, False])
def test_a_cuda_hop_never_waits_for_the_device(nets, accumulate):
    """Indices from host state, copied without blocking: torch's sync debug mode raises on any
    host synchronisation, over hops of 15 and 16 frames, none, and a jump; every way of the
    temporal branches."""
    batch = MusicnnBatch(on(nets[0], "cuda"), capacity=3, accumulate=accumulate)
    rng = np.random.default_rng(2)
    for s in range(3):
        batch.reset(s)
    batch.push([0, 1, 2], [frames(rng, 16)] * 3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ks in ((15, 16, 16), (16, 0, 15), (80, 16, 15)):
            batch.push([0, 1, 2], [frames(rng, k) for k in ks])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@CUDA
def test_a_cuda_front_end_hop_from_audio_never_waits_for_the_device():
    """The front end's many-stream hop from audio (audio/frontends.py: the streams' sample
    frames, their log-mels on the device, the network): no host synchronisation."""
    from audio.frontends import build_frontend
    from audio.sources import DemoSource
    slots = build_frontend("musicnn", device="cuda").batch(3)
    streams = [(slots.join(), iter(DemoSource(seed=i))) for i in range(3)]
    push = lambda: slots.push([s for s, _ in streams], [next(h) for _, h in streams])   # noqa: E731
    push()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            push()
    finally:
        torch.cuda.set_sync_debug_mode("default")
