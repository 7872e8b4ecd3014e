"""The candidate form of the continual musicnn push that `bench --engines` measures: MusicnnBatch's
push (audio/musicnn/batch.py) for G streams that each bring k new frames, as one pure function of
their caches in patch order (no ring, no host indices), the shape an inference engine compiles.
The CPU default's branches: K = 128 keeps accumulators, K = 64 and 32 recompute the rows a hop
changes. Its taggrams equal MusicnnBatch's, bit for bit at one stream (tests/app/test_bench.py);
it is a measurement, not the app's path.

Shapes: G streams, P = 187 patch rows, k new frames, C' = 51 temporal channels."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from audio.musicnn import BANDS, TEMPORAL_CH, conv1d, same_padding
from audio.musicnn.batch import EDGE, P, TIMBRAL_FEATS, MusicnnBatch


class PushGraph(nn.Module):
    def __init__(self, fb: MusicnnBatch, k: int):
        super().__init__()
        if fb.accumulate != (True, False, False) or not 0 < k < same_padding(fb.temporal[0][0])[0]:
            raise ValueError("PushGraph takes the CPU default's branches and 1 <= k <= 62 frames")
        self.fb, self.k = fb, k
        K0 = fb.temporal[0][0]
        b0, a0 = same_padding(K0)
        self.taps_out = fb._taps_for(0, ("out", k), range(k, b0), range(0, k))
        self.taps_start = fb._taps_for(0, ("start", k), range(b0 - k, b0), range(0, K0 - 1))
        self.taps_old = fb._taps_for(0, ("old", k), range(P - k - a0, P - k), range(P - k, P))
        self.taps_new = fb._taps_for(0, ("new", k), range(P - k, P), range(P - k - b0, P))

    def forward(self, patch, timbral, mid, f0, f1, f2, zs0, ze0, new):
        """patch (G, P, 96) normalised, timbral (G, P, 408), mid (G, P, 64), f0..f2 (G, P, C'),
        zs0 (G, b, C', 96), ze0 (G, a, C', 96), new (G, k, 96) log-mel frames -> the same caches
        after the hop, then the taggrams (G, 50)."""
        fb, k, net = self.fb, self.k, self.fb.net
        G = patch.shape[0]
        x = net.normalize(new)                                             # (G, k, 96)
        old = patch
        patch = torch.cat([old[:, k:], x], dim=1)                          # (G, P, 96)
        # K = 128, accumulating
        K0, bn0, _, bias0, _ = fb.temporal[0]
        b, a = same_padding(K0)
        bias = bias0.view(-1, 1)
        lose = (self.taps_out @ old[:, :k]).view(G, b - k, TEMPORAL_CH, BANDS)
        fresh = (self.taps_start @ patch[:, :K0 - 1]).view(G, k, TEMPORAL_CH, BANDS) + bias
        zs = torch.cat([zs0[:, k:] - lose, fresh], dim=1)                  # rows 0 .. b-1
        z = torch.cat([self.taps_old @ patch[:, P - k:], self.taps_new @ patch[:, P - k - b:]],
                      dim=1).view(G, a + k, TEMPORAL_CH, BANDS)            # rows P-k-a .. P-1
        out = z[:, :k] + ze0[:, :k]                                        # rows P-k-a .. P-a-1 (k <= a)
        ze = torch.cat([ze0[:, k:] + z[:, k:a], z[:, a:] + bias], dim=1)    # rows P-a .. P-1
        f0 = torch.cat([bn0.after_max(zs.amax(dim=3)), f0[:, b + k:P - a],
                        bn0.max_relu(out, dim=3), bn0.after_max(ze.amax(dim=3))], dim=1)
        # K = 64, 32: the rows a hop changes, recomputed
        fs = []
        for j, f in ((1, f1), (2, f2)):
            Kj, bnj, _, _, _ = fb.temporal[j]
            bj, aj = same_padding(Kj)
            tail = F.pad(patch[:, P - k - aj - bj:], (0, 0, 0, aj))
            head = F.pad(patch[:, :bj + aj], (0, 0, bj, 0))
            t_rows, h_rows = (bnj.max_relu(F.conv2d(seg[:, None], *fb.conv[j])[:, :TEMPORAL_CH].permute(0, 2, 1, 3), dim=3)
                              for seg in (tail, head))
            fs.append(torch.cat([h_rows, f[:, bj + k:P - aj], t_rows], dim=1))
        # timbral: rows P-3-k .. P-4 became interior; mid rows P-6-k .. P-7
        rows = fb._timbral_rows(patch[:, P - k - 2 * EDGE:])                # (G, k, 408)
        timbral = torch.cat([timbral[:, k:P - EDGE], rows, timbral[:, P - EDGE:]], dim=1)
        m_new = conv1d(timbral[:, P - 3 * EDGE - k:P - EDGE].transpose(1, 2).contiguous(), fb.mid_timbral).transpose(1, 2)
        mid = torch.cat([mid[:, k:P - 2 * EDGE], m_new, mid[:, P - 2 * EDGE:]], dim=1)
        # the head
        zeros = patch.new_zeros(G, EDGE, BANDS)
        edges = fb._timbral_rows(torch.cat([torch.cat([zeros, patch[:, :2 * EDGE]], dim=1),
                                            torch.cat([patch[:, -2 * EDGE:], zeros], dim=1)]))
        tim = torch.cat([edges[:G], timbral[:, EDGE:P - EDGE], edges[G:]], dim=1)
        front = torch.cat([tim, f0, fs[0], fs[1]], dim=2).transpose(1, 2).contiguous()   # (G, 561, P)
        zc = conv1d(front[:, TIMBRAL_FEATS:], fb.mid_temporal, net.mid[0].bias, padding=3)
        ends = front.new_zeros(2 * G, TIMBRAL_FEATS, 4 * EDGE)
        ends[:G, :, EDGE:] = front[:, :TIMBRAL_FEATS, :3 * EDGE]
        ends[G:, :, :3 * EDGE] = front[:, :TIMBRAL_FEATS, P - 3 * EDGE:]
        ends = conv1d(ends, fb.mid_timbral)
        zc = torch.cat([zc[:, :, :2 * EDGE] + ends[:G], zc[:, :, 2 * EDGE:P - 2 * EDGE]
                        + mid[:, 2 * EDGE:P - 2 * EDGE].transpose(1, 2), zc[:, :, P - 2 * EDGE:] + ends[G:]], dim=2)
        taggram = torch.sigmoid(net.head_after_conv(front, zc))
        return patch, timbral, mid, f0, fs[0], fs[1], zs, ze, taggram


def state_of(fb: MusicnnBatch, idx) -> list[torch.Tensor]:
    """The caches of slots ``idx`` in patch order, PushGraph's inputs before the new frames."""
    idx = np.asarray(idx)
    st = fb.state
    b, a = same_padding(fb.temporal[0][0])
    g = len(idx)
    return [fb._rows(n, idx, 0, P) for n in ("patch", "timbral", "mid", "f0", "f1", "f2")] + [
        st["zs0"].view(-1, TEMPORAL_CH, BANDS)[fb._ring(idx, 0, b, b)].view(g, b, TEMPORAL_CH, BANDS),
        st["ze0"].view(-1, TEMPORAL_CH, BANDS)[fb._ring(idx, P - a, a, a)].view(g, a, TEMPORAL_CH, BANDS)]
