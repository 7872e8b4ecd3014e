"""The bookkeeping of continual landmarks (models/landmarks.py): the stream-aligned segments of
a window kept in ring order, what a step does from its position alone (warm-up, steady, a
landmark replaced), the landmark slots in stream order, and the tracker rebuilt from a window
(a live switch from fixed landmarks)."""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor, nn

from ..landmarks import aligned_segments, segment_sizes

F32, I64 = torch.float32, torch.int64


class Segments(nn.Module):
    """The stream-aligned segments of a window kept in ring order (slot t % n holds token t), for
    every count of tokens seen: models/landmarks.aligned_segments mapped once to the ring slot of
    every window position (while the window fills, position = slot; after, the pattern repeats
    every n tokens). ``means(x, seen)``: the segments' means; ``sizes``: the segment sizes."""

    def __init__(self, n: int, m: int):
        super().__init__()
        self.n, self.m = n, m
        table = torch.full((2 * n, n), -1, dtype=I64)          # -1: in no segment
        for seen in range(1, 2 * n):
            row = seen if seen < n else n + seen % n
            for i, (a, b) in enumerate(aligned_segments(seen, n, m)):
                for w in range(a, b):
                    table[row, (seen + w) % n if seen >= n else w] = i
        self.register_buffer("table", table)
        self.register_buffer("marks", torch.arange(m))
        self.register_buffer("sizes", torch.tensor(segment_sizes(n, m)))

    def ids(self, seen: Tensor) -> Tensor:
        """(S, n) the landmark each ring slot's token belongs to after ``seen`` (S,) tokens,
        m for a slot in no segment."""
        row = torch.where(seen < self.n, seen, self.n + seen % self.n)
        ids = self.table[row]
        return torch.where(ids < 0, self.m, ids)

    def means(self, x: Tensor, seen: Tensor) -> tuple[Tensor, Tensor]:
        """x (S, H, n, dh) or (S, n, D) in ring order -> the segment means (S, H, m, dh) or
        (S, m, D), zeros for landmarks not there yet (fewer than m tokens), and present (S, m).
        Sums by scatter: n_t additions of a row each (as models/flops.py counts them). On CUDA,
        whose scatter adds atomically in any order (a stream's bits would change from run to
        run), by a product with the (S, m, n) 0/1 membership instead: the same sums, deterministic."""
        ids = self.ids(seen)                                                      # (S, n)
        member = (ids.unsqueeze(1) == self.marks.view(1, -1, 1)).to(x.dtype)      # (S, m, n)
        count = member.sum(dim=-1)                                                # (S, m)
        shape = (count.shape[0], *([1] * (x.dim() - 3)), self.m, 1)
        if x.is_cuda:
            sums = torch.matmul(member.unsqueeze(1) if x.dim() == 4 else member, x)   # (S, [H,] m, dh)
        else:
            axis = x.dim() - 2
            index = ids.view(ids.shape[0], *([1] * (axis - 1)), -1, 1).expand(*x.shape)
            sums = x.new_zeros(*x.shape[:axis], self.m + 1, x.shape[-1]).scatter_add(axis, index, x)
            sums = sums.narrow(axis, 0, self.m)
        return sums / torch.clamp(count, min=1).view(shape), count > 0


def stream_order(q_land: Tensor, k_land: Tensor, completed: int, m: int) -> tuple[Tensor, Tensor]:
    """Landmark slots (..., m, dh) oldest segment first: the slot order rolled by the segments
    completed (slot = segment index % m)."""
    shift = -(completed % m)
    return torch.roll(q_land, shift, dims=-2), torch.roll(k_land, shift, dims=-2)


def landmark_event(t, n: int, m: int):
    """What a continual-landmark step at positions t (an int or int array) does, from the
    positions alone: 0 warm-up (t < n), 1 steady, 2 a segment completes and its landmark is
    replaced. The segment sums (``NystromStep.push``) complete segment j of each n tokens when
    (t + 1) mod n is the sum of the first j + 1 sizes (mod n)."""
    t = np.asarray(t)
    return np.where(t < n, 0, _cycle(n, m)[t % n])


@functools.lru_cache(maxsize=64)
def _cycle(n: int, m: int) -> np.ndarray:
    """(n,) the event code of a step past warm-up at each position mod n."""
    bounds = np.cumsum(segment_sizes(n, m)) % n
    return np.where(np.isin((np.arange(n) + 1) % n, bounds), 2, 1)


def resume(s, seen: Tensor, n: int, m: int):
    """The continual-landmark state after ``seen`` (S,) tokens rebuilt from the window kept in
    the rings (a stream that ran with fixed landmarks switches to continual ones): the segment
    sums, the completed count and the landmark slots as if the stream had tracked them all along
    (a landmark whose segment reaches back beyond the window is the mean of its in-window part),
    and the landmarks in use: (state, q landmarks, k landmarks (S, H, m, dh), present (S, m)).
    ``s``: a nystrom.NystromState; installing the landmarks is ``NystromStep.resumed``'s."""
    sizes = segment_sizes(n, m)
    bounds = [sum(sizes[:i]) for i in range(m + 1)]
    fields = {name: getattr(s, name).clone() for name in ("seg_q", "seg_k", "seg_count", "completed", "q_land", "k_land")}
    qs, ks = [], []
    for i, t in enumerate(seen.tolist()):
        if t == 0:
            qs.append(s.q_land[i])
            ks.append(s.k_land[i])
            continue
        n_t = min(t, n)
        order = (torch.arange(n_t) + (t - n_t)) % n
        q, k = s.q_ring[i][:, order], s.k_ring[i][:, order]                      # (H, n_t, dh) oldest first
        cycles, rem = divmod(t, n)
        done = max(j for j, b in enumerate(bounds) if b <= rem)
        completed, count = cycles * m + done, rem - bounds[done]
        fields["completed"][i], fields["seg_count"][i] = completed, count
        fields["seg_q"][i] = q[:, n_t - count:].sum(dim=1)
        fields["seg_k"][i] = k[:, n_t - count:].sum(dim=1)
        w0, stop = t - n_t, t - count
        for j in range(min(m, completed)):          # newest completed segment first
            index = completed - 1 - j
            size = sizes[index % m]
            a, b = max(stop - size, w0) - w0, stop - w0
            fields["q_land"][i, :, index % m] = q[:, a:b].mean(dim=1)
            fields["k_land"][i, :, index % m] = k[:, a:b].mean(dim=1)
            stop -= size
        if completed >= m:
            qs.append(fields["q_land"][i])
            ks.append(fields["k_land"][i])
        else:                                       # warm-up: the segment means of the tokens seen
            spans = aligned_segments(t, n, m)
            ql = torch.stack([q[:, a:b].mean(dim=1) for a, b in spans], dim=1)
            kl = torch.stack([k[:, a:b].mean(dim=1) for a, b in spans], dim=1)
            pad = m - ql.shape[1]
            qs.append(torch.cat([ql, ql.new_zeros(ql.shape[0], pad, ql.shape[2])], dim=1))
            ks.append(torch.cat([kl, kl.new_zeros(kl.shape[0], pad, kl.shape[2])], dim=1))
    present = torch.stack([torch.arange(m) < min(m, t) if 0 < t < n else torch.ones(m, dtype=torch.bool)
                           for t in seen.tolist()]).to(s.q_land.device)
    return s._replace(**fields), torch.stack(qs), torch.stack(ks), present
