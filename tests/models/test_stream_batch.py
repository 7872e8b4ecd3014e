"""Many streams of one model in one batch (models/stream/batch.py): each stream's logits equal
its own single-stream float64 step at every step, whatever else is in the batch and whenever it
joined; one stream's NaN tokens or events change no other stream's values. On CUDA (skipped
without it) the same, through the captured CUDA graphs, and a steady step never waits for the
device."""
import copy
import random

import pytest
import torch

from error_model import model_scores, relative_tol
from models.landmarks import fit_fixed_landmarks
from models.stream.batch import SlotsFull, StreamBatch
from models.stream.segments import landmark_event
from tiny import tiny_model

STAGES = 6          # float32 stages chained in a block (as tests/app/test_onnx_export.py): embedding,
                    # q/k/v projection, scores, softmax sums, output projection, feed-forward
NYSTROM_STAGES = 10  # the same with Nystrom attention's six (tests/models/test_fused.py: three
                     # softmax factors, the pseudo-inverse, two products) for scores and sums
N, M, D = 8, 2, 16
CASES = [(v, mode, layers) for layers in (1, 2) for v, mode in (
    ("regular", None), ("nystrom", None), ("nystrom", "fixed"), ("continual", None),
    ("continual_nystrom", "continual"), ("continual_nystrom", "fixed"))]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def model_of(variant: str, mode: str | None, layers: int, seed: int = 0):
    model = tiny_model(variant, n=N, in_dim=D, landmarks=M, layers=layers, seed=seed)
    if mode == "fixed":
        g = torch.Generator().manual_seed(seed)
        fit_fixed_landmarks(model, [torch.rand(8, N, D, generator=g)], seed=0)
        model.set_landmark_mode("fixed")
    return model.use_fused(False)


@pytest.mark.parametrize("device", DEVICES + ["cpu-fused", "cpu-masked"])
@pytest.mark.parametrize("variant, mode, layers", CASES)
def test_each_stream_equals_its_own_float64_step_as_streams_join_and_leave(variant, mode, layers, device, errors, seed):
    """cpu-fused: the CPU's default for a model that the compiled backend takes (its steady
    streams stepped by it, the others by the torch step, on the same slots); cpu-masked: the
    CUDA path's step (every event a mask, no host branch) on the CPU; the other devices step the
    model's explicit-state step (models/stream/model.py) as their default."""
    model = model_of(variant, mode, layers, seed)
    if device == "cpu-masked":
        batch = StreamBatch(copy.deepcopy(model), capacity=4, events="masked")
        assert not batch.fused and (not batch.continual or batch.stepper.events == "masked")
    elif device == "cpu-fused":
        batch = StreamBatch(copy.deepcopy(model).use_fused(True), capacity=4)
        if not batch.fused:
            pytest.skip(f"{variant} with {layers} block(s) has no compiled step")
        assert batch.state[0].shape[0] == 5                            # one state: 4 slots and the spare
    else:
        batch = StreamBatch(copy.deepcopy(model).to(device), capacity=4)
        assert not batch.fused
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    alone: dict[int, tuple] = {}                 # slot -> (float64 model, its tokens so far)
    worst, joined, left = (0.0, 1.0), 0, 0
    for hop in range(56):
        if batch.streams < 4 and hop % 3 == 0:                      # joins every third hop while room
            exact = copy.deepcopy(model).double()
            exact.reset(1)
            alone[batch.join()] = (exact, [])
            joined += 1
        if hop % 11 == 10:                                          # a random stream leaves
            slot = rng.choice(sorted(alone))
            batch.leave(slot)
            del alone[slot]
            left += 1
        slots = torch.tensor(sorted(alone))
        scale = 1 + 9 * (hop % 20 >= 10)                          # the tokens' scale swings 10x
        tokens = torch.rand(len(slots), D, generator=g) * scale
        got = batch.step(slots, tokens).cpu()
        for i, slot in enumerate(slots.tolist()):
            exact, seen = alone[slot]
            seen.append(tokens[i].double())
            want = exact.step(tokens[i:i + 1].double())[0]
            window = torch.stack(seen[-N:])[None]
            stages = (NYSTROM_STAGES if "nystrom" in variant else STAGES) * layers
            tol = relative_tol(model_scores(exact, window, exact.window_start()), N, stages)
            err = (got[i].double() - want).abs().max().item() / max(1.0, want.abs().max().item())
            if err / tol > worst[0] / worst[1]:
                worst = (err, tol)
    assert joined >= 8 and left == 5                                   # streams came and went
    errors(f"stream batch {variant}/{mode} {layers} block(s) on {device} vs float64", *worst)


@pytest.mark.parametrize("device", DEVICES + ["cpu-masked"])
@pytest.mark.parametrize("variant, mode, layers", [c for c in CASES if c[2] == 1] + [("continual_nystrom", "continual", 2)])
def test_a_streams_nan_tokens_and_events_change_no_other_stream(variant, mode, layers, device):
    """Three streams at different positions (so at different events: warm-up, landmark
    replacement, steady): the first two give the same bits whether the third is fed NaN, huge
    or ordinary tokens (cpu-masked: the CUDA path's masked step, on the CPU)."""
    masked = device == "cpu-masked"
    device = "cpu" if masked else device
    model = model_of(variant, mode, layers).to(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.rand(40, 3, D, generator=g)
    runs = []
    for third in ("ordinary", "nan", "huge"):
        batch = StreamBatch(model, capacity=3, events="masked" if masked else None)
        outs = []
        for hop in range(40):
            if hop in (0, 5, 13):                                   # joins at different hops
                batch.join()
            slots = torch.arange(min(3, 1 + (hop >= 5) + (hop >= 13)))
            x = tokens[hop, :len(slots)].clone()
            if len(slots) == 3:
                x[2] = {"ordinary": x[2], "nan": torch.full((D,), float("nan")), "huge": x[2] * 1e6}[third]
            outs.append(batch.step(slots, x)[:2].cpu())
        runs.append(outs)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    assert all(torch.isfinite(o).all() for o in runs[1])


def test_slots_are_reused_and_refused_when_full():
    batch = StreamBatch(model_of("continual", None, 1), capacity=2)
    a, b = batch.join(), batch.join()
    with pytest.raises(SlotsFull, match="all 2 slots"):
        batch.join()
    batch.leave(a)
    assert batch.join() == a and batch.streams == 2
    assert (a, b) == (0, 1)


def test_flops_follow_the_single_stream_formulas():
    """Per stream, the FLOPs of its position and events: the single-stream step's."""
    for variant, mode in (("regular", None), ("continual_nystrom", "continual"), ("continual", None)):
        model = model_of(variant, mode, 1)
        single = copy.deepcopy(model)
        single.reset(1)
        batch = StreamBatch(model, capacity=1)
        batch.join()
        g = torch.Generator().manual_seed(2)
        for _ in range(3 * N):
            x = torch.rand(1, D, generator=g)
            single.step(x)
            batch.step(torch.tensor([0]), x)
            assert batch.step_flops(0) == single.step_flops()
            assert batch.windows_full()[0] == single.window_full()


@CUDA
@pytest.mark.parametrize("variant, mode, layers", CASES)
def test_a_steady_cuda_step_never_waits_for_the_device(variant, mode, layers):
    """Past warm-up a step is a replayed CUDA graph: torch's sync debug mode raises on any host
    synchronisation. Each round steps 5 streams, then 3 of them, then another one (buckets of
    8, 4 and 1 rows, the streams at different positions). Three window lengths of rounds first
    capture every graph the checked rounds replay (a capture itself synchronises, once;
    continual landmarks: steady and replacing groups per bucket), then two more are checked."""
    batch = StreamBatch(model_of(variant, mode, layers).to("cuda"), capacity=5)
    slots = [batch.join() for _ in range(5)]
    x = torch.rand(5, D, device="cuda")
    steps = [(slots, x), (slots[:3], x[:3]), (slots[4:], x[4:])]
    for _ in range(3 * N):
        for s, tokens in steps:
            batch.step(s, tokens)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2 * N):
            for s, tokens in steps:
                batch.step(s, tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("n, m, layers", [(8, 2, 1), (7, 3, 1), (7, 3, 2)])
def test_the_hosts_landmark_schedule_is_the_steps_own(n, m, layers):
    """StreamBatch computes only the branch a continual-landmark step takes, told by the
    positions alone (nystrom.landmark_event): for streams joined at different hops, the
    prediction equals the events the masked step computes itself (a warm-up rebuild for t < n,
    a landmark replaced when a segment completes), segments of unequal sizes included. (That the
    logits then equal each stream's own float64 step is the first test's.)"""
    model = tiny_model("continual_nystrom", n=n, in_dim=D, landmarks=m, layers=layers, seed=3).use_fused(False)
    masked = StreamBatch(model, capacity=3)
    masked.landmarks_tracked = False                                   # every step masked: the oracle
    g = torch.Generator().manual_seed(0)
    seen = set()
    for hop in range(4 * n):
        if hop in (0, 2, n + 1):
            masked.join()
        slots = list(range(masked.streams))
        masked.step(slots, torch.rand(len(slots), D, generator=g))
        code = landmark_event(masked.stepped - 1, n, m)
        events = masked.events_host()
        assert (events[:, 0] == (code == 0)).all() and (events[:, 1] == (code == 2)).all()
        seen |= set(code.tolist())
    assert seen == {0, 1, 2}
