"""musicnn's opt-in bf16 (audio/musicnn: ``product_dtype``): the continual front ends' products
that hold no state take bf16 operands: the timbral ones, and the temporal ones where a branch is
recomputed (the CPU's batch and one stream's push; accumulators, CUDA's default, stay float32),
everything else float32. Every form computes it (the batch, one stream's eager graph bit for bit
with the batch of one, a batch keeping accumulators), and each stream's taggram is the float64
network's on the bf16-rounded operands within the error model below, at every hop; the rounding
does not build up over a stream (the last hops are checked too). A precision that the hardware or
the front end cannot run is a one-line PrecisionError before any work; on a CPU with avx512_bf16
or AMX (skipped elsewhere) `classify --precision bf16` runs and says so. The compiled push
(AOTInductor) in bf16, and the batch on CUDA (skipped without a GPU with bf16), are held to the
same bound.

Error model. The products' operands are rounded to bf16 (the oracle rounds them the same way,
then computes in float64). A product of two bf16 numbers is exact in float32; torch sums the
n terms of a pre-activation in float32 (n = 7 w for a timbral one, at most K for a temporal one:
at most n EPS32 of the sum of their magnitudes, S) and rounds the sum to bf16 (at most U_BF16 =
2^-8 of it). Rounding is monotone, so the max over frequency of the rounded sums is the rounded
max: each maximum m_i moves by at most dm_i = U_BF16 |m_i| + n EPS32 S, the bias then added in
float32. The rest of the network is piecewise linear in m up to the logits, so to first order a
logit moves by sum_i J_i e_i (J = dlogit/dm by autograd on the float64 oracle) with e_i the
maxima's rounding errors: independent and uniform within +-dm_i (standard deviation
dm_i / sqrt(3)), tens of thousands of them, so the move is normal with sigma =
sqrt(sum_i (J_i dm_i)^2 / 3). A tag's taggram moves by sigmoid'(logit) times that. The largest of
a few hundred such deviations (tags x checks) is about 3 sigmas, so a tag's tolerance is SIGMAS =
10 of its sigmas (the bound for every error in one direction is some 40 sigmas, never seen), on
top of the float32 error model of tests/audio/test_musicnn_batch.py. Checked tag by tag: the
figure reported is the largest error of a tag over its own tolerance."""
import copy
import subprocess
import sys

import numpy as np
import pytest
import torch

from audio import musicnn
from audio.errors import PrecisionError
from audio.frontends import build_frontend
from audio.musicnn import branches as musicnn_branches
from audio.musicnn.batch import EDGE, MusicnnBatch
from audio.musicnn.graph import CompiledPushes, GraphStream, prepare
from error_model import EPS32
from test_musicnn_batch import frames, patch_of, taggram_tol

U_BF16 = 2.0 ** -8                   # bf16's unit roundoff: 8 significant bits
SIGMAS = 10
HOPS = [15, 16, 40, 0, 1, 80, 16, 200, 15, 16, 15, 16, 16, 15, 16, 15]
CHECKED = {2, 6, 9, 15}              # hops whose taggrams meet the oracle (each a Jacobian)
CUDA = pytest.mark.skipif(not torch.cuda.is_available() or not torch.cuda.is_bf16_supported(including_emulation=False),
                          reason="no CUDA device with bf16")
BF16_CPU = pytest.mark.skipif(not musicnn.bf16_hardware(), reason="this CPU has neither avx512_bf16 nor AMX")


@pytest.fixture(scope="module")
def nets():
    net, _ = musicnn.build_musicnn()
    net.requires_grad_(False)
    low = copy.deepcopy(net)
    low.precision = "bf16"
    return low, copy.deepcopy(net).double()


def oracle(low, net64, history, temporal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(50,) taggram of the float64 network on the stream's 187 frames with the timbral products'
    operands rounded to bf16 as the front ends round them (``temporal``: the temporal ones too,
    as where a branch is recomputed), and (50,) the error model's tolerance of each tag."""
    x32 = low.normalize(patch_of(history).float())                             # (1, 187, 96) as pushed
    x64 = x32.double()
    xb = torch.nn.functional.pad(x32, (0, 0, EDGE, EDGE)).bfloat16().double()  # the products' frames
    maxima, slack = [], []
    timbral, temporal_branches = musicnn_branches.timbral_branches(low), musicnn_branches.temporal_branches(low)
    for w, _, weight, _ in timbral:
        cols = xb.unfold(1, 2 * EDGE + 1, 1).unfold(2, w, 1).reshape(-1, (2 * EDGE + 1) * w)
        z = (cols @ weight.double()).view(187, 96 - w + 1, -1)[:, :, :musicnn.TIMBRAL_CH]
        size = (cols.abs() @ weight.double().abs()).view(187, 96 - w + 1, -1)[:, :, :musicnn.TIMBRAL_CH]
        maxima.append(z.amax(dim=1))                                          # (187, 204)
        slack.append(U_BF16 * z.amax(dim=1).abs() + (2 * EDGE + 1) * w * EPS32 * size.amax(dim=1))
    for K, _, _, _, w in temporal_branches if temporal else ():              # (K, C') taps, sign-folded
        windows = torch.nn.functional.pad(x32[0], (0, 0) + musicnn.same_padding(K)).bfloat16().double().unfold(0, K, 1)
        taps = w.bfloat16().double()                                          # windows (187, 96, K)
        z, size = windows @ taps, windows.abs() @ taps.abs()                   # (187, 96, C')
        maxima.append(z.amax(dim=1))
        slack.append(U_BF16 * z.amax(dim=1).abs() + K * EPS32 * size.amax(dim=1))
    parts = list(zip(double_bns([b[1] for b in timbral] + [b[1] for b in temporal_branches]),
                     [b[3] for b in timbral] + [b[3] for b in temporal_branches]))   # (BN, bias)

    def logits(m):                                                            # (187, 408 [+ 153]) maxima -> (50,)
        feats = [bn.after_max(part + bias.double()) for part, (bn, bias) in zip(m.split(musicnn.TIMBRAL_CH, dim=1)[:2], parts)]
        feats += ([bn.after_max(part + bias.double()) for part, (bn, bias) in
                   zip(m[:, 2 * musicnn.TIMBRAL_CH:].split(musicnn.TEMPORAL_CH, dim=1), parts[2:])]
                  if temporal else [net64.temporal_same(x64)[0]])
        return net64.head(torch.cat(feats, dim=1)[None])[0]

    m = torch.cat(maxima, dim=1)
    with torch.enable_grad():
        jac = torch.autograd.functional.jacobian(logits, m, vectorize=True)   # (50, 187, 408 [+ 153])
    sigma = ((jac * torch.cat(slack, dim=1)) ** 2).sum(dim=(1, 2)).div(3).sqrt()   # (50,) of the logits
    out = logits(m)
    taggram = torch.sigmoid(out)
    return taggram, SIGMAS * taggram * (1 - taggram) * sigma + taggram_tol(out)


def double_bns(bns):
    """The SignedBNs in float64 (the oracle's)."""
    out = []
    for bn in bns:
        d = copy.copy(bn)
        d.scale, d.shift, d.sign = bn.scale.double(), bn.shift.double(), bn.sign.double()
        out.append(d)
    return out


def test_every_form_in_bf16_is_the_float64_network_on_rounded_operands(nets, errors):
    low, net64 = nets
    rng = np.random.default_rng(5)
    batch, accumulating, graph, one = (MusicnnBatch(low, 2, chunk=1), MusicnnBatch(low, 1, accumulate=True),
                                       GraphStream(low), MusicnnBatch(low, 1))
    for fb, slot in ((batch, 0), (batch, 1), (one, 0), (accumulating, 0)):
        fb.reset(slot)
    assert batch.timbral[0][2].dtype == torch.bfloat16 and batch.mid_timbral.dtype == torch.float32
    histories, worst = [[], []], 0.0
    for hop, k in enumerate(HOPS):
        xs = [frames(rng, k), frames(rng, HOPS[(hop + 5) % len(HOPS)])]
        got = batch.push([0, 1], xs)
        alone, graphed = accumulating.push([0], [xs[0]])[0], graph.push(xs[0])
        assert torch.equal(graphed, one.push([0], [xs[0]])[0]), hop                 # the graph is the batch of one
        for i in range(2):
            histories[i].append(xs[i])
        if hop in CHECKED:                   # the batch and the graph recompute their temporal rows
            oracles = {(i, temporal): oracle(low, net64, histories[i], temporal) for i, temporal in ((0, True), (1, True), (0, False))}
            for taggram, i, temporal in ((got[0], 0, True), (got[1], 1, True), (alone, 0, False), (graphed, 0, True)):
                want, bound = oracles[i, temporal]
                worst = max(worst, ((taggram.double() - want).abs() / bound).max().item())
    assert {t.dtype for (_, key), t in batch._taps.items() if key in ("tail", "head")} == {torch.bfloat16}
    errors("bf16 taggrams (batch, one stream's graph, a batch keeping accumulators) vs the float64 network on bf16 operands, "
           "each tag over its tolerance", worst, 1.0)


@CUDA
def test_the_batch_on_cuda_in_bf16_is_within_the_same_bound(nets, errors):
    low, net64 = nets
    batch, rng, history, worst = MusicnnBatch(copy.deepcopy(low).cuda(), 3), np.random.default_rng(7), [], 0.0
    for slot in range(3):
        batch.reset(slot)
    for hop in range(10):
        xs = [frames(rng, 16 - (hop + s) % 2) for s in range(3)]
        got = batch.push([0, 1, 2], xs).cpu()
        history.append(xs[1])
        if hop in (2, 9):
            want, bound = oracle(low, net64, history)
            worst = max(worst, ((got[1].double() - want).abs() / bound).max().item())
    errors("bf16 taggrams on CUDA vs the float64 network on bf16 operands, each tag over its tolerance", worst, 1.0)


def test_the_compiled_push_in_bf16_is_within_the_same_bound(nets, errors):
    """Its own libraries (the precision is in their names), from the prepared cache (`make test`
    prepares them; else built here once)."""
    low, net64 = nets
    assert not prepare(torch.get_num_threads(), mode="bf16").startswith("not built"), "this machine cannot compile the push"
    pushes = CompiledPushes("MSD_musicnn", musicnn.load_weights()[1], (16,), "bf16")
    assert pushes.status == "compiled" and "-bf16-k16-" in str(pushes.paths[16])
    rng = np.random.default_rng(6)
    compiled, history, worst = GraphStream(low, pushes), [], 0.0
    for hop in range(8):
        history.append(frames(rng, 16))
        got = compiled.push(history[-1])
        if hop in (1, 7):
            want, bound = oracle(low, net64, history, temporal=True)
            worst = max(worst, ((got.double() - want).abs() / bound).max().item())
    errors("the compiled bf16 push vs the float64 network on bf16 operands, each tag over its tolerance", worst, 1.0)


def test_a_precision_that_cannot_run_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(musicnn, "bf16_hardware", lambda: False)             # a CPU without bf16 (this one may have it)
    for kwargs, words in [(dict(precision="bf16"), "precision bf16 needs a CPU with avx512_bf16 or AMX"),
                          (dict(precision="tf32"), "precision tf32 is for --device cuda"),
                          (dict(precision="bf16", continual=False), "precision bf16 is for the continual front end"),
                          (dict(precision="fp8"), "unknown precision 'fp8'")]:
        with pytest.raises(PrecisionError) as e:
            build_frontend("musicnn", **kwargs)
        assert str(e.value).startswith(words) and "\n" not in str(e.value)
    with pytest.raises(PrecisionError, match="VGGish runs float32"):
        build_frontend("vggish", random_vggish=0, precision="bf16")


@BF16_CPU
def test_classify_in_bf16_runs_and_says_so():
    r = subprocess.run([sys.executable, "main.py", "classify", "--demo", "--seconds", "2", "--precision", "bf16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "device cpu, float32, musicnn in bf16 products;" in r.stderr
    assert "(pretrained, continual, bf16 products)" in r.stderr and "verdict over demo" in r.stderr
