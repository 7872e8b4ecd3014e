"""The continual musicnn front end, for one stream or many: C slots of per-stream caches stacked
into tensors, and one ``push`` computing the new frames of every stream given at once, by the
branches' exact schemes (audio/musicnn/branches.py: interior timbral rows cached, temporal rows
recomputed or their edge rows' pre-activations accumulated).

The layout:

* every per-stream cache has a slot axis, and its patch rows sit in a ring (``start[slot]``
  counts the rows the stream has moved by; patch row p sits in ring row (start + p) mod the
  ring's length), so a hop moves no cached row;
* a temporal branch with accumulators keeps them only for its edge rows, in two rings of b and
  a rows (the rows whose window reaches before the patch, and past it);
* the streams of a hop are grouped by how many frames they bring (15 or 16 for 0.25 s hops):
  one group's timbral rows are one matrix product per branch, its temporal updates one product
  per branch with the streams side by side in the columns (the tap matrices depend on k only);
* only the temporal rows a hop changed are reduced over frequency (a per-slot feature cache;
  an edge ring's maxima and sums on CUDA by one gather or scatter for all slots, on the CPU
  slot by slot in place: ``slotwise``);
* the mid-end's first convolution is split by its input channels: its timbral part (408 of 561
  channels) is a stream value for every row whose window holds interior timbral rows only, so
  it is cached per ring row and computed for the k rows that became such and the 6 + 6 at the
  patch's ends (58 MFLOPs a stream-hop fewer at 16 frames, 11 %: tests/audio/test_musicnn_batch.py
  holds the count to torch's FLOP counter);
* the mid-end and back-end run once for every stream of the hop (CPU: of a chunk, ``chunk``);
* no step waits for the device: ring indices come from host state (``start``) and reach the
  device by asynchronous copies, the hop's frames in one.

A slot starts as if preceded by digital silence (log-mel 0): its caches are those of a patch of
silence, computed once (``template``) in the network's precision, as every push. Each stream's
taggram equals Musicnn's on its 187 frames within float32 rounding, whatever else is in the batch
(tests/audio/test_musicnn_batch.py; bf16: test_musicnn_precision.py). Every operation is row- or
column-wise in the streams: a stream's NaN frames reach no other. One CPU stream runs the same
push as one graph (audio/musicnn/graph.py), eager or compiled.

Shapes: C slots, P = 187 patch rows, S streams pushed, G of them in a group, k new frames.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import (BANDS, conv1d, precision, MID_CH, PATCH_FRAMES, TAGS, TEMPORAL, TEMPORAL_CH, TIMBRAL, TIMBRAL_CH, TIMBRAL_COLS, Musicnn,
               head_macs, product_dtype, same_padding, timbral_macs_per_frame)
from .branches import temporal_branches, timbral_branches, timbral_features, toeplitz_taps

P, EDGE, SHIFT_MAX = PATCH_FRAMES, 3, PATCH_FRAMES - max(TEMPORAL)   # SHIFT_MAX: more new frames are a jump
CPU_CHUNK = 8                                          # streams computed together on the CPU
CPU_ACCUMULATE = (False, False, False)                 # temporal branches (K = 128, 64, 32) with accumulators on the CPU
TF32_ACCUMULATE = (True, False, False)                 # and on CUDA in TF32
TIMBRAL_FEATS = len(TIMBRAL) * TIMBRAL_CH            # 408
MID_TIMBRAL_MACS = 7 * TIMBRAL_FEATS * MID_CH          # the first mid-end convolution's timbral part, per row


def per_branch(accumulate: bool | tuple | list) -> tuple[bool, ...]:
    """One flag for every temporal branch, or one per branch (K = 128, 64, 32)."""
    if isinstance(accumulate, (tuple, list)):
        return tuple(bool(a) for a in accumulate)
    return (bool(accumulate),) * len(TEMPORAL)


def default_accumulate(device_type: str, mode: str = "float32") -> tuple[bool, ...]:
    """Which temporal branches keep accumulators by default (``MusicnnBatch``): none on the CPU;
    on CUDA every branch in float32 or bf16 (cuDNN off, ``precision``) and the K = 128 one in
    TF32 (with cuDNN): the ways measured fastest (docs/benchmarks.md, design measurements)."""
    if device_type != "cuda":
        return CPU_ACCUMULATE
    return TF32_ACCUMULATE if mode == "tf32" else per_branch(True)


def on_device(a: np.ndarray, device: torch.device) -> Tensor:
    """A host array on ``device`` without waiting (pinned and asynchronous on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class MusicnnBatch:
    """``reset(slot)`` starts a stream in a slot (preceded by silence: ``template``);
    ``push(slots, frames) -> (S, 50)`` taggrams. Which slots are free is the caller's business.

    ``accumulate`` (per temporal branch, K = 128, 64, 32) keeps a branch's pre-activations of
    its K - 1 edge rows (127, 63 or 31 rows of 51 x 96 floats: 2.5, 1.2 or 0.6 MB per slot) and
    updates them by the frames that leave and arrive: the fewest multiply-accumulates, and
    memory-bound (every edge row is read and written each hop). A branch without them keeps only
    its features and recomputes the k + K - 1 rows a hop changes, by one matrix product per end
    of the patch with the streams side by side in its columns (``_recompute``): no state, 3.8x
    the multiply-accumulates for K = 128, 2.3x for 64, 1.6x for 32 at 16 frames, at the matrix
    product's speed. The default on the CPU recomputes every branch; on CUDA in TF32 the K = 128
    branch accumulates, in float32 and bf16 every branch.

    ``chunk``: streams computed together (CPU: 8, so that a hop's temporaries stop growing with
    the streams, at no cost in time; CUDA: all of them, in the fewest launches). The figures
    behind each choice: docs/benchmarks.md, design measurements."""

    def __init__(self, net: Musicnn, capacity: int, *, accumulate: bool | tuple | None = None,
                 chunk: int | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.net, self.capacity = net, capacity
        self.device = next(net.buffers()).device
        cuda = self.device.type == "cuda"
        self.accumulate = per_branch(default_accumulate(self.device.type, net.precision) if accumulate is None
                                     else accumulate)                                  # per temporal branch
        self.chunk = max(1, chunk or (capacity if cuda else CPU_CHUNK))
        self.slotwise = not cuda                       # edge rings: per slot in place, or one gather / scatter
        self.timbral, self.product_dtype = timbral_branches(net), product_dtype(net.precision)   # (w, bn, weight, bias)
        self.temporal = temporal_branches(net)                                       # (K, bn, weight, bias, w)
        self._taps: dict = {}
        w = net.mid[0].weight                                                         # (64, 561, 7)
        self.mid_timbral = w[:, :TIMBRAL_FEATS].contiguous()
        self.mid_temporal = w[:, TIMBRAL_FEATS:].contiguous()
        shapes = {"patch": (P, BANDS), "timbral": (P, TIMBRAL_FEATS), "mid": (P, MID_CH), "last": (TAGS,)}
        for j, kernel in enumerate(TEMPORAL):
            b, a = same_padding(kernel)
            if self.accumulate[j]:
                shapes[f"zs{j}"], shapes[f"ze{j}"] = (b, TEMPORAL_CH, BANDS), (a, TEMPORAL_CH, BANDS)
            shapes[f"f{j}"] = (P, TEMPORAL_CH)
        self.state = {name: torch.zeros((capacity, *shape), device=self.device) for name, shape in shapes.items()}
        self.start = np.zeros(capacity, np.int64)        # rows moved since the slot's reset (ring origin)
        self.macs = np.zeros(capacity, np.int64)          # multiply-accumulates of each slot's last push
        self.template = self._silence()

    # ------------------------------------------------------------------ slots
    @torch.no_grad()
    def _silence(self) -> dict[str, Tensor]:
        """One slot's caches for a patch of silence (ring origin 0), computed in slot 0 as a jump
        to that patch is, in the network's precision like every push (on CUDA outside it, cuDNN's
        TF32 convolutions would put every taggram whose patch still holds that silence past the
        float32 error bound)."""
        with precision(self.net.precision, self.device):
            slot = np.zeros(1, np.int64)
            self._refill(slot, self.net.normalize(torch.zeros(1, P, BANDS, device=self.device)))
            self.state["last"][0] = torch.sigmoid(self._head(slot))[0]
        self.macs[0] = 0
        return {name: t[0].clone() for name, t in self.state.items()}

    def reset(self, slot: int) -> None:
        """Slot ``slot`` holds a fresh stream."""
        for name, t in self.template.items():
            self.state[name][slot] = t
        self.start[slot] = 0

    # ------------------------------------------------------------------ a hop
    @torch.no_grad()
    def push(self, slots: list[int], frames: list[Tensor | np.ndarray]) -> Tensor:
        """frames[i]: (k_i, 96) new log-mel frames of stream ``slots[i]`` -> (S, 50) taggrams on
        the network's device. Nothing here waits for the device: indices are built on the host
        from host state and copied without blocking, the frames in one copy."""
        arrays = [np.asarray(f.cpu() if isinstance(f, Tensor) else f, dtype=np.float32).reshape(-1, BANDS)
                  for f in frames]
        rows = self._dev(np.concatenate(arrays + [np.zeros((0, BANDS), np.float32)]))
        return self.push_rows(slots, rows, [len(a) for a in arrays])

    @torch.no_grad()
    def push_rows(self, slots: list[int], rows: Tensor, counts: list[int]) -> Tensor:
        """The same with every stream's frames in one tensor on the network's device: rows
        (sum counts, 96), stream i's the counts[i] after the streams' before it."""
        with precision(self.net.precision, self.device):
            return self._push(np.asarray(slots, np.int64), rows, np.asarray(counts, np.int64))

    def _push(self, slots: np.ndarray, new: Tensor, counts: np.ndarray) -> Tensor:
        if len(slots) <= self.chunk:
            return self._push_chunk(slots, new, counts)
        out = torch.empty(len(slots), TAGS, device=self.device)
        ends = np.cumsum(counts)
        for lo in range(0, len(slots), self.chunk):
            hi = min(lo + self.chunk, len(slots))
            first = int(ends[lo] - counts[lo])
            out[lo:hi] = self._push_chunk(slots[lo:hi], new[first:int(ends[hi - 1])], counts[lo:hi])
        return out

    def _push_chunk(self, slots: np.ndarray, new: Tensor, counts: np.ndarray) -> Tensor:
        ks = np.minimum(counts, P)                       # more than a patch: its last P frames
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]) + counts - ks if len(ks) else ks
        out = torch.empty(len(slots), TAGS, device=self.device)
        moved = np.flatnonzero(ks > 0)                   # positions in ``slots`` whose patch moves
        still = np.flatnonzero(ks == 0)                  # nothing new: the last taggram again
        if len(still):
            out[self._dev(still)] = self.state["last"][self._dev(slots[still])]
            self.macs[slots[still]] = 0
        for k in np.unique(ks[moved]).tolist():
            members = np.flatnonzero(ks == k)
            idx = slots[members]
            rows = offsets[members][:, None] + np.arange(k)                          # (G, k)
            x = self.net.normalize(new[self._dev(rows.reshape(-1))].view(len(members), k, BANDS))
            if k > SHIFT_MAX:                            # a jump: every cache from the new patch
                self._refill(idx, x)
            else:
                self._shift(idx, x, k)
        if len(moved):
            idx = self._dev(slots[moved])
            taggrams = torch.sigmoid(self._head(slots[moved]))                           # (M, 50)
            self.state["last"][idx] = taggrams
            out[self._dev(moved)] = taggrams
            self.macs[slots[moved]] += head_macs() - (P - 4 * EDGE) * MID_TIMBRAL_MACS
        return out

    def _dev(self, a: np.ndarray) -> Tensor:
        return on_device(a, self.device)

    def _ring_rows(self, idx: np.ndarray, first: int, count: int, n: int) -> np.ndarray:
        """(G, count) ring rows of patch rows first .. first + count - 1 of slots idx in a ring of
        n rows (patch row p in ring row (start + p) mod n)."""
        return (self.start[np.asarray(idx)][:, None] + np.arange(first, first + count)) % n

    def _ring(self, idx: np.ndarray, first: int, count: int, n: int = P) -> Tensor:
        """(G * count,) flat indices (slot * n + ring row) of those rows."""
        return self._dev((np.asarray(idx)[:, None] * n + self._ring_rows(idx, first, count, n)).reshape(-1))

    def _rows(self, name: str, idx: np.ndarray, first: int, count: int) -> Tensor:
        """(G, count, C): patch rows first .. first + count - 1 of state ``name`` (slots, P, C),
        slots idx."""
        t = self.state[name]
        return t.view(-1, t.shape[-1])[self._ring(idx, first, count)].view(len(idx), count, -1)

    def _timbral_rows(self, x: Tensor) -> Tensor:
        """(N, L, 96) normalised frames (padding in place) -> (N, L - 6, 408): both timbral
        branches, one matrix product per branch (its im2col the only copy of the frames)."""
        n, rows = x.shape[0], x.shape[1] - 2 * EDGE
        out = x.new_empty(n, rows, TIMBRAL_FEATS)
        x = x.to(self.product_dtype)
        for i, branch in enumerate(self.timbral):
            w = branch[0]
            cols = x.unfold(1, 2 * EDGE + 1, 1).unfold(2, w, 1).reshape(-1, (2 * EDGE + 1) * w)
            out[:, :, i * TIMBRAL_CH:(i + 1) * TIMBRAL_CH] = timbral_features(branch, cols).view(n, rows, -1)
        return out

    def _mid_rows(self, timbral: Tensor) -> Tensor:
        """(G, L, 408) timbral rows -> (G, L - 6, 64): the first mid-end convolution's timbral
        part (no bias) of the rows whose 7-row window they fill."""
        return conv1d(timbral.transpose(1, 2).contiguous(), self.mid_timbral).transpose(1, 2)

    def _taps_for(self, j: int, key, rows: range, frames: range, skip_below: int | None = None) -> Tensor:
        """Branch j's Toeplitz taps, made once: the recomputed ends' in ``product_dtype``."""
        if (j, key) not in self._taps:
            (kernel, _, _, _, w), dtype = self.temporal[j], self.product_dtype if key in ("tail", "head") else torch.float32
            self._taps[j, key] = toeplitz_taps(w, same_padding(kernel)[0], rows, frames, skip_below).to(dtype)
        return self._taps[j, key]

    def _shift(self, idx: np.ndarray, x: Tensor, k: int) -> None:
        """Slots ``idx`` receive k normalised frames x (G, k, 96): every cache updated."""
        st = self.state
        old = self._rows("patch", idx, 0, P)                                          # (G, P, 96) row order
        patch = torch.cat([old[:, k:], x], dim=1)
        st["patch"].view(-1, BANDS)[self._ring(idx, 0, k)] = x.reshape(-1, BANDS)   # rows 0..k-1 leave, the new take their ring rows
        macs = self._temporal(idx, old, patch, k)
        # timbral: rows P-3-k .. P-4 became interior (the 3 + 3 edge rows: ``_front``)
        fresh = self._timbral_rows(patch[:, P - k - 2 * EDGE:])                        # (G, k, 408)
        st["timbral"].view(-1, TIMBRAL_FEATS)[self._ring(idx, P - EDGE - k, k)] = fresh.reshape(-1, TIMBRAL_FEATS)
        # the mid-end's first convolution, timbral part: rows P-6-k .. P-7 now see interior rows only
        window = self._rows("timbral", idx, P - 3 * EDGE - k, k + 2 * EDGE)           # (G, k + 6, 408)
        st["mid"].view(-1, MID_CH)[self._ring(idx, P - 2 * EDGE - k, k)] = self._mid_rows(window).reshape(-1, MID_CH)
        self.macs[idx] = macs + (k + 2 * EDGE) * timbral_macs_per_frame(TIMBRAL_COLS) + k * MID_TIMBRAL_MACS

    def _temporal(self, idx: np.ndarray, old: Tensor, patch: Tensor, k: int) -> int:
        """The temporal branches' rows a hop changed, P-k-a .. P-1 (their windows reach the new
        frames) and 0 .. b-1 (theirs lost the old ones): a branch with accumulators updates its
        edge rows by the frames that leave and arrive, and sums the rows that became start-edge
        rows over the new patch; one without recomputes those rows from the new patch (G, P, 96)
        and its zero padding. Moves the slots' ring origins by k."""
        st = self.state
        # frames 0..k-1 of the old patch leave old rows k .. b-1, which stay start-edge rows (one
        # product per branch for the group: (G, (b-k)*C', 96) = taps ((b-k)*C', k) @ frames (G, k, 96))
        for j, (kernel, _, _, _, _) in enumerate(self.temporal):
            b, a = same_padding(kernel)
            if self.accumulate[j] and k < b:
                out = self._taps_for(j, ("out", k), range(k, b), range(0, k)) @ old[:, :k]
                self._ring_add(st[f"zs{j}"], idx, k, b - k, b, out.view(len(idx), b - k, TEMPORAL_CH, BANDS), alpha=-1.0)
        self.start[idx] += k                                                           # old row p is now p - k
        macs, low = 0, patch.to(self.product_dtype)
        for j, (kernel, bn, _, _, _) in enumerate(self.temporal):
            b, a = same_padding(kernel)
            if self.accumulate[j]:
                macs += self._edge_rows(j, idx, patch, k)
                continue
            rows, more = self._recompute(j, low, k)                                    # (G, k+K-1, C'): one cyclic run
            st[f"f{j}"].view(-1, TEMPORAL_CH)[self._ring(idx, P - k - a, k + kernel - 1)] = rows.reshape(-1, TEMPORAL_CH)
            macs += more
        return macs

    def _recompute(self, j: int, patch: Tensor, k: int) -> tuple[Tensor, int]:
        """(G, k + K - 1, C') features of branch j's rows P-k-a .. P-1 then 0 .. b-1 of the new patch (G, P, 96)
        in ``product_dtype`` (they hold no state; converted once for every branch), and the multiply-accumulates
        per stream: each end one product of its Toeplitz taps (rows C', frames; the end's for k the lower right
        corner of those for SHIFT_MAX) with the streams' frames side by side (frames, G 96), the max over
        frequency (in float32: the same floats, faster), then the bias."""
        kernel, bn, _, bias, _ = self.temporal[j]
        (b, a), G, feats, skip = same_padding(kernel), patch.shape[0], [], SHIFT_MAX - k
        tail = self._taps_for(j, "tail", range(P - SHIFT_MAX - a, P), range(P - SHIFT_MAX - a - b, P))
        ends = ((tail[skip * TEMPORAL_CH:, skip:], P - k - a - b), (self._taps_for(j, "head", range(0, b), range(0, kernel - 1)), 0))
        for taps, first in ends:                                                      # taps (R C', F), first frame
            x = patch[:, first:first + taps.shape[1]].transpose(0, 1).reshape(taps.shape[1], G * BANDS)
            feats.append((taps @ x).float().view(-1, TEMPORAL_CH, G, BANDS).amax(dim=3).permute(2, 0, 1))   # (G, R, C')
        macs = sum(taps.numel() for taps, _ in ends) * BANDS
        return bn.after_max(torch.cat(feats, dim=1) + bias), macs

    def _edge_rows(self, j: int, idx: np.ndarray, patch: Tensor, k: int) -> int:
        """Branch j's edge rings after the origin moved by k (old start-edge rows already lost
        the leaving frames): the rows that became start-edge rows summed over the new patch, the
        new frames added to the old end-edge rows and the new rows, the k rows that became
        interior (or skipped the end ring) taken out as features. Returns its multiply-accumulates."""
        kernel, bn, _, bias, _ = self.temporal[j]
        st, G, (b, a) = self.state, len(idx), same_padding(kernel)
        zs, ze = (st[f"{name}{j}"].view(-1, TEMPORAL_CH, BANDS) for name in ("zs", "ze"))
        bias = bias.view(-1, 1)
        # rows b-n .. b-1 became start-edge rows: sums over the new patch's frames 0 .. K-2
        n = min(k, b)
        fresh = self._taps_for(j, ("start", n), range(b - n, b), range(0, kernel - 1)) @ patch[:, :kernel - 1]
        zs[self._ring(idx, b - n, n, b)] = fresh.view(-1, TEMPORAL_CH, BANDS).add_(bias)
        # rows P-k-a .. P-1, the a old end-edge rows then the k new ones: an old row gains the new
        # frames P-k .. P-1 only, a new row sums its window's frames from P-k-b on (one product
        # each: no zero taps). The first k of these rows leave the end ring (interior now), the
        # last a stay in it
        old = (self._taps_for(j, ("old", k), range(P - k - a, P - k), range(P - k, P)) @ patch[:, P - k:]
               ).view(G, a, TEMPORAL_CH, BANDS)
        new = (self._taps_for(j, ("new", k), range(P - k, P), range(P - k - b, P)) @ patch[:, P - k - b:]
               ).view(G, k, TEMPORAL_CH, BANDS)
        if k > a:                                        # (a short branch, a long hop) new rows interior at once
            out = torch.cat([old, new[:, :k - a] + bias], dim=1)
            out[:, :a] += ze.index_select(0, self._ring(idx, P - k - a, a, a)).view(G, a, TEMPORAL_CH, BANDS)
            ze[self._ring(idx, P - a, a, a)] = (new[:, k - a:] + bias).reshape(-1, TEMPORAL_CH, BANDS)
        else:
            out = old[:, :k]
            out += ze.index_select(0, self._ring(idx, P - k - a, k, a)).view(G, k, TEMPORAL_CH, BANDS)
            self._ring_add(st[f"ze{j}"], idx, P - a, a - k, a, old[:, k:])
            ze[self._ring(idx, P - k, k, a)] = (new + bias).view(-1, TEMPORAL_CH, BANDS)   # the ring rows ``out`` left
        st[f"f{j}"].view(-1, TEMPORAL_CH)[self._ring(idx, P - k - a, k)] = bn.max_relu(out, dim=3).reshape(-1, TEMPORAL_CH)
        self._features(idx, bn, st[f"zs{j}"], st[f"f{j}"], 0, b)
        self._features(idx, bn, st[f"ze{j}"], st[f"f{j}"], P - a, a)
        return TEMPORAL_CH * BANDS * (max(b - k, 0) * k + n * (kernel - 1) + a * k + k * (k + b))

    def _ring_add(self, z: Tensor, idx: np.ndarray, first: int, count: int, n: int, rows: Tensor,
                  alpha: float = 1.0) -> None:
        """Add alpha x rows (G, count, C', 96) to patch rows first .. first + count - 1 of slots
        idx in their ring z (C, n, C', 96): on the CPU slot by slot (a slot's rows are
        contiguous, so nothing is copied), on CUDA in one call."""
        if not self.slotwise:
            z.view(-1, TEMPORAL_CH, BANDS).index_add_(0, self._ring(idx, first, count, n),
                                                      rows.reshape(-1, TEMPORAL_CH, BANDS), alpha=alpha)
            return
        local = torch.from_numpy(self._ring_rows(idx, first, count, n))
        for g, slot in enumerate(idx.tolist()):
            z[slot].index_add_(0, local[g], rows[g], alpha=alpha)

    def _features(self, idx: np.ndarray, bn, z: Tensor, f: Tensor, first: int, n: int) -> None:
        """Features f (C, P, C') of patch rows first .. first + n - 1 of slots idx from their
        pre-activations z (C, n, C', 96), a ring that these rows fill (row p in ring row
        (start + p) mod n), put in patch order. On the CPU the max over each slot's ring as it
        lies (nothing copied); on CUDA one gather for every slot (a launch per slot would cost
        more than the copy): ``slotwise``. Both give the same floats."""
        if self.slotwise:
            peaks = z.new_empty(len(idx), n, TEMPORAL_CH)                             # ring order
            for g, slot in enumerate(idx.tolist()):
                torch.amax(z[slot], dim=2, out=peaks[g])
            local = np.arange(len(idx))[:, None] * n + self._ring_rows(idx, first, n, n)
            peaks = peaks.view(-1, TEMPORAL_CH).index_select(0, self._dev(local.reshape(-1)))
        else:                                                                           # patch order
            peaks = z.view(-1, TEMPORAL_CH, BANDS).index_select(0, self._ring(idx, first, n, n)).amax(dim=2)
        f.view(-1, TEMPORAL_CH)[self._ring(idx, first, n)] = bn.after_max(peaks)

    def _refill(self, idx: np.ndarray, x: Tensor) -> None:
        """Slots ``idx`` jumped by a whole patch or more: their caches recomputed from it."""
        st, sl = self.state, self._dev(idx)
        old = self._rows("patch", idx, 0, P)
        patch = torch.cat([old, x], dim=1)[:, -P:]                                     # (G, P, 96)
        self.start[idx] = 0
        st["patch"][sl] = patch
        padded = torch.nn.functional.pad(patch, (0, 0, EDGE, EDGE))
        st["timbral"][sl] = self._timbral_rows(padded)
        st["mid"][sl, 2 * EDGE:P - 2 * EDGE] = self._mid_rows(st["timbral"][sl, EDGE:P - EDGE])
        macs = (P + 2 * EDGE) * timbral_macs_per_frame(TIMBRAL_COLS) + (P - 4 * EDGE) * MID_TIMBRAL_MACS   # (+ _front's edge rows)
        for j, (kernel, bn, weight, bias, _) in enumerate(self.temporal):
            b, a = same_padding(kernel)
            z = torch.nn.functional.conv2d(torch.nn.functional.pad(patch, (0, 0, b, a))[:, None],
                                           weight, bias)                               # (G, C', P, 96)
            z = z.permute(0, 2, 1, 3)                                                  # (G, P, C', 96)
            if self.accumulate[j]:                       # the edge rows, ring origin 0
                st[f"zs{j}"].view(-1, TEMPORAL_CH, BANDS)[self._ring(idx, 0, b, b)] = z[:, :b].reshape(-1, TEMPORAL_CH, BANDS)
                st[f"ze{j}"].view(-1, TEMPORAL_CH, BANDS)[self._ring(idx, P - a, a, a)] = z[:, P - a:].reshape(-1, TEMPORAL_CH, BANDS)
            st[f"f{j}"][sl] = bn.max_relu(z, dim=3)
            macs += TEMPORAL_CH * BANDS * P * kernel
        self.macs[idx] = macs

    def _head(self, idx: np.ndarray) -> Tensor:
        """(M, 50) logits of slots idx, from their caches in patch row order."""
        st, M, order = self.state, len(idx), self._ring(idx, 0, P)
        patch = st["patch"].view(-1, BANDS)[order].view(M, P, BANDS)
        temporal = [st[f"f{j}"].view(-1, TEMPORAL_CH)[order].view(M, P, -1) for j in range(len(TEMPORAL))]
        return self.logits(patch, self._rows("timbral", idx, EDGE, P - 2 * EDGE), self._rows("mid", idx, 2 * EDGE, P - 4 * EDGE),
                           temporal)

    def logits(self, patch: Tensor, interior: Tensor, mid: Tensor, temporal: list[Tensor]) -> Tensor:
        """(M, 50) logits of M streams from their caches in patch row order: patch (M, P, 96)
        normalised, interior (M, P - 6, 408) timbral rows 3 .. P-4, mid (M, P - 12, 64) the first
        mid-end convolution's timbral part of rows 6 .. P-7, temporal [(M, P, C')] features.
        The timbral edge rows are computed with the patch's zero padding; the first mid-end
        convolution, split by its input channels, is its temporal part over the whole patch plus
        the cached timbral part, and that part computed for the 6 + 6 rows at the patch's ends.
        MusicnnBatch's hop and PushGraph both end here."""
        M = patch.shape[0]
        zeros = patch.new_zeros(M, EDGE, BANDS)
        edges = self._timbral_rows(torch.cat([torch.cat([zeros, patch[:, :2 * EDGE]], dim=1),
                                              torch.cat([patch[:, -2 * EDGE:], zeros], dim=1)]))   # (2M, 3, 408)
        timbral = torch.cat([edges[:M], interior, edges[M:]], dim=1)                   # (M, P, 408)
        x = torch.cat([timbral] + temporal, dim=2).transpose(1, 2).contiguous()        # (M, 561, P)
        z = conv1d(x[:, TIMBRAL_FEATS:], self.mid_temporal, self.net.mid[0].bias, padding=3)
        ends = x.new_zeros(2 * M, TIMBRAL_FEATS, 4 * EDGE)                             # 9 rows and the padding
        ends[:M, :, EDGE:] = x[:, :TIMBRAL_FEATS, :3 * EDGE]
        ends[M:, :, :3 * EDGE] = x[:, :TIMBRAL_FEATS, P - 3 * EDGE:]
        ends = conv1d(ends, self.mid_timbral)                                          # (2M, 64, 6)
        z = torch.cat([z[:, :, :2 * EDGE] + ends[:M], z[:, :, 2 * EDGE:P - 2 * EDGE] + mid.transpose(1, 2),
                       z[:, :, P - 2 * EDGE:] + ends[M:]], dim=2)
        return self.net.head_after_conv(x, z)
