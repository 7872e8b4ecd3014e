"""A continual model's streaming step as a pure function of explicit state, for ONNX export.

``stream_graph(model)`` (app/offline/onnx_export.py) is an nn.Module whose ``forward(token, t, *state)``
returns ``(logits, t + 1, events, *next_state)``: one step of ``model.step`` with every piece of
streaming state (ring buffers, cached scores, running sums, landmark segments, landmarks and their
pseudo-inverse) an input and an output, and the data-dependent events of a step inside the graph:
writes to a ring slot and the departure of the oldest key are masks (``where``); running-max
rescaling is branch-free (a factor exp(0) = 1 leaves a row bit for bit); the rare events are
``torch.cond`` (an ONNX ``If``): a stale row recomputed from its cached scores, a continual
landmark replaced, the warm-up steps that rebuild everything from the partial window.

Shapes (batch 1, heads H, head width dh, window n, m landmarks): token (1, in_dim) float32,
t () int64, logits (1, classes), events (3,) int64: whether the step rebuilt everything (warm-up),
replaced a landmark, and how many rows it recomputed (what the step's FLOPs depend on). At t = 0
every state input is replaced by the initial state, so a stream starts from zeros of the inputs'
shapes (``initial_state``) and t = 0.

Each graph is one block's attention (``attend``: the newest token's q, k, v and the state -> the
attention output and the next state) and, as ``forward``, a 1-block model around it. With
``retroactive`` (block 0 of a 2-block model, models/stream/two_block.py) ``attend`` returns
the outputs of every ring slot, (H, n, dh), instead of the newest token's (H, dh).

Here: ``continual`` (single-output and retroactive SDA, Hedegaard et al.) and ``continual_nystrom``
with fixed landmarks; continual landmarks (Carreto Picón et al.) are in
models/stream/graph_landmarks.py. The arithmetic is the torch step's (models/sda/continual.py,
continual_nystrom.py, running_sums.py): Nyström rows in float64, retroactive rows in float32, the
pseudo-inverse from ``landmark_pinv`` rounded to float32 as the step keeps it.
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as nnf

from ..landmarks import aligned_segments
from ..running_sums import TAU, fresh_sums
from ..sda.reference import landmark_pinv, pinv

F64 = torch.float64
EXPORTABLE = ("continual", "continual_nystrom")


class NotExportable(ValueError):
    """A model whose step has no explicit-state graph."""


@dataclass(frozen=True)
class StateTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def branch(pred: Tensor, yes, no, operands: tuple, masked: bool) -> tuple[Tensor, ...]:
    """A rare event of the step: ``torch.cond`` (an ONNX If: one branch runs), or, ``masked``,
    both branches and a select by ``pred`` (``where``), which batches over streams (torch.func.vmap:
    each stream its own event) and needs no host synchronisation. Both give the same values."""
    if not masked:
        return torch.cond(pred, yes, no, operands)
    return tuple(torch.where(pred, a, b) for a, b in zip(yes(*operands), no(*operands)))


class StreamGraph(nn.Module, abc.ABC):
    """One block's streaming attention with explicit state; embedding, projections, block tail
    and head around it make a 1-block model's step. ``masked``: events as selects (``branch``)."""

    kind = ""
    masked = False

    def __init__(self, model, block: int = 0):
        super().__init__()
        cfg, block = model.cfg, model.blocks[block]
        self.cfg, self.block, self.retroactive = cfg, block, block.retroactive
        self.n, self.H, self.dh = cfg.window, cfg.heads, cfg.d_model // cfg.heads
        self.embed, self.head, self.attn = model.embed, model.head, block.attn
        self.register_buffer("table", model.pos.table.detach().clone())
        self.register_buffer("slots", torch.arange(self.n))
        self.scale = 1.0 / math.sqrt(self.dh)

    @abc.abstractmethod
    def state_spec(self) -> list[StateTensor]:
        """Name, shape and dtype of every state input, in the order ``forward`` takes them."""

    def initial_state(self) -> list[Tensor]:
        """Zeros of every state input (the graph starts a stream at t = 0 whatever they hold)."""
        return [torch.zeros(s.shape, dtype=s.dtype) for s in self.state_spec()]

    @abc.abstractmethod
    def attend(self, t: Tensor, q: Tensor, k: Tensor, v: Tensor, *state: Tensor):
        """The t-th token's q, k, v (H, dh) and the state -> (attention output, events (3,),
        *next state); the output is (H, dh), or (H, n, dh) in ring order when retroactive."""

    def forward(self, token: Tensor, t: Tensor, *state: Tensor):
        """A 1-block model's step: token (1, in_dim), t (), state -> logits, t + 1, events, state."""
        h, q, k, v = self.project(token, t)
        a, events, *state = self.attend(t, q, k, v, *state)
        return (self.finish(h, a), t + 1, events, *state)

    def project(self, token: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """token (1, in_dim), t () -> h (1, d_model) and q, k, v (H, dh)."""
        position = torch.index_select(self.table, 0, (t % self.table.shape[0]).view(1))     # (1, d)
        h = nnf.linear(token, self.embed.weight, self.embed.bias) + position
        qkv = nnf.linear(h, self.attn.in_proj.weight, self.attn.in_proj.bias).view(3, self.H, self.dh)
        return h, qkv[0].clone(), qkv[1].clone(), qkv[2].clone()     # not views of one tensor

    def finish(self, h: Tensor, a: Tensor) -> Tensor:
        """Attention output a (H, dh) -> logits (1, classes): out-projection, tail, head."""
        a = nnf.linear(a.reshape(1, -1), self.attn.out_proj.weight, self.attn.out_proj.bias)
        return nnf.linear(self.block._tail(h, a), self.head.weight, self.head.bias)

    def slot_mask(self, t: Tensor) -> Tensor:
        """(n,) True at the ring slot the t-th token takes."""
        return self.slots == t % self.n

    @staticmethod
    def fresh(t: Tensor, state: list[Tensor]) -> list[Tensor]:
        """At t = 0, the initial state (zeros) whatever ``state`` holds."""
        start = t == 0
        return [torch.where(start, s.new_zeros(()), s) for s in state]


class ContinualGraph(StreamGraph):
    """Continual single-output SDA: the newest query over the cached keys and values."""

    kind = "continual"

    def state_spec(self) -> list[StateTensor]:
        return self.spec(self.H, self.n, self.dh, 0, False)

    @staticmethod
    def spec(H: int, n: int, dh: int, m: int, retroactive: bool) -> list[StateTensor]:
        ring = (H, n, dh)
        return [StateTensor("k_ring", ring, torch.float32), StateTensor("v_ring", ring, torch.float32)]

    def attend(self, t, q, k, v, k_ring, v_ring):
        k_ring, v_ring = self.fresh(t, [k_ring, v_ring])
        here = self.slot_mask(t).view(1, self.n, 1)
        k_ring = torch.where(here, k.unsqueeze(1), k_ring)
        v_ring = torch.where(here, v.unsqueeze(1), v_ring)
        scores = torch.matmul(k_ring, (q * self.scale).unsqueeze(-1)).squeeze(-1)     # (H, n)
        scores = scores.masked_fill((self.slots > t).view(1, self.n), float("-inf"))
        a = torch.matmul(torch.softmax(scores, dim=-1).unsqueeze(1), v_ring).squeeze(1)
        return a, t.new_zeros(3), k_ring, v_ring


class RetroactiveGraph(StreamGraph):
    """Continual retroactive SDA: every query of the window as a running-sum row (float32, as
    the torch step keeps them), the departing key removed with the scores it was added with,
    the newest key added to every row, the newest query's row from scratch. ``key_scores``
    (H, n keys, n rows) caches every score, key-major as the Nyström rows' cache."""

    kind = "continual"

    def state_spec(self) -> list[StateTensor]:
        return self.spec(self.H, self.n, self.dh, 0, True)

    @staticmethod
    def spec(H: int, n: int, dh: int, m: int, retroactive: bool) -> list[StateTensor]:
        f32 = torch.float32
        return [StateTensor("q_ring", (H, n, dh), f32), StateTensor("k_ring", (H, n, dh), f32),
                StateTensor("v_ring", (H, n, dh), f32), StateTensor("key_scores", (H, n, n), f32),
                StateTensor("ref", (H, n), f32), StateTensor("den", (H, n), f32),
                StateTensor("num", (H, n, dh), f32), StateTensor("peak", (H, n), f32)]

    def attend(self, t, q, k, v, q_ring, k_ring, v_ring, key_scores, ref, den, num, peak):
        q_ring, k_ring, v_ring, key_scores, den, num, peak = self.fresh(
            t, [q_ring, k_ring, v_ring, key_scores, den, num, peak])
        ref = torch.where(t == 0, ref.new_full((), float("-inf")), ref)
        here = self.slot_mask(t)
        valid = self.slots < t + 1                          # (n,) filled slots, keys and rows alike
        q_ring = torch.where(here.view(1, -1, 1), q.unsqueeze(1), q_ring)
        k_ring = torch.where(here.view(1, -1, 1), k.unsqueeze(1), k_ring)
        column = torch.matmul(q_ring, k.unsqueeze(-1)).squeeze(-1) * self.scale        # (H, n)
        v_ring, key_scores, ref, den, num, peak = slide(
            here, t >= self.n, column, v, v_ring, key_scores, ref, den, num, peak)
        row = torch.matmul(k_ring, q.unsqueeze(-1)).squeeze(-1) * self.scale           # (H, n)
        key_scores = torch.where(here.view(1, 1, -1), row.unsqueeze(-1), key_scores)
        r, d, nm = fresh_rows(row.unsqueeze(1), valid, v_ring, torch.float32)
        ref, den = torch.where(here, r, ref), torch.where(here, d, den)
        num, peak = torch.where(here.view(1, -1, 1), nm, num), torch.where(here, d, peak)
        ref, den, num, peak, stale = refresh(valid, key_scores, v_ring, ref, den, num, peak,
                                             rows=valid & (t > 0), masked=self.masked)
        a = torch.where(valid.view(1, -1, 1), num / den.unsqueeze(-1), num.new_zeros(()))
        events = torch.stack([stale.new_zeros(()), stale.new_zeros(()), stale])
        return a, events, q_ring, k_ring, v_ring, key_scores, ref, den, num, peak


# ----------------------------------------------------------------------------- Nyström

def dense(*xs: Tensor) -> tuple[Tensor, ...]:
    """Branch outputs as new, contiguous tensors: torch.cond needs both branches' strides to
    agree and no output to alias an input (x + 0 is x, -inf included, and never an alias)."""
    return tuple((x.reshape(-1) + x.new_zeros(())).reshape(x.shape) for x in xs)


def fresh_rows(scores: Tensor, valid: Tensor, v_ring: Tensor, dtype=F64) -> tuple[Tensor, Tensor, Tensor]:
    """Row sums from scratch (running_sums.fresh_sums) over the valid slots, in ``dtype``.
    scores: (H, R, n) float32 cached scaled scores; valid: (n,) bool; v_ring (H, n, dh)
    -> ref (H, R), den (H, R), num (H, R, dh)."""
    sums = fresh_sums(scores.to(dtype).masked_fill(~valid.view(1, 1, -1), float("-inf")), v_ring.to(dtype))
    return sums.ref, sums.den, sums.num                  # exp(-inf) = 0: invalid slots add nothing


def present_pinv(ql: Tensor, kl: Tensor, present: Tensor, iters: int) -> Tensor:
    """``landmark_pinv`` of the present landmarks (present: (m,) bool), the absent ones padded:
    their columns of s(Q~ K~^T) masked, their rows the identity's. pinv(blockdiag(A, I)) is
    blockdiag(pinv(A), I) through the same iteration on A (its scaling takes A's norms: A's
    rows sum to 1, its largest column sum is >= 1), with exact zeros off the block, so an
    output whose softmax over landmarks masks the absent ones (``masked``) equals the one with
    the present landmarks alone. (H, m, dh) x 2 -> (H, m, m) float32."""
    s = 1.0 / math.sqrt(ql.shape[-1])
    logits = torch.matmul(ql.to(F64) * s, kl.to(F64).transpose(-1, -2))
    kernel = torch.softmax(masked(logits, present), dim=-1)
    eye = torch.eye(ql.shape[1], dtype=F64, device=ql.device)
    return pinv(torch.where(present.view(1, -1, 1), kernel, eye), iters).to(ql.dtype)


class SegmentMeans(nn.Module):
    """Means of the stream-aligned segments of a window kept in ring order (slot t % n holds
    the t-th token): models/landmarks.aligned_segments, mapped once, at export, to the ring slot
    of every window position for every count of tokens seen (while the window fills, position
    = slot; after, the pattern repeats every n tokens)."""

    def __init__(self, n: int, m: int):
        super().__init__()
        self.n = n
        table = torch.full((2 * n, n), -1, dtype=torch.int64)          # -1: in no segment
        for seen in range(1, 2 * n):
            row = seen if seen < n else n + seen % n
            for i, (a, b) in enumerate(aligned_segments(seen, n, m)):
                for w in range(a, b):
                    table[row, (seen + w) % n if seen >= n else w] = i
        self.register_buffer("table", table)
        self.register_buffer("rows", torch.arange(m).view(m, 1))

    def forward(self, x: Tensor, seen: Tensor) -> tuple[Tensor, Tensor]:
        """x (..., n, d) in ring order, ``seen`` () tokens -> means (..., m, d), zero rows for
        the landmarks not there yet (fewer than m tokens seen), and present (m,)."""
        row = torch.where(seen < self.n, seen, self.n + seen % self.n)
        member = (torch.index_select(self.table, 0, row.view(1)) == self.rows).to(x.dtype)   # (m, n)
        count = member.sum(dim=-1, keepdim=True)
        return torch.matmul(member, x) / torch.clamp(count, min=1), count.view(-1) > 0


def masked(logits: Tensor, present: Tensor | None) -> Tensor:
    """-inf in the columns of absent landmarks (present: (m,) bool, or None: all present)."""
    return logits if present is None else logits.masked_fill(~present, float("-inf"))


def nystrom_output(q: Tensor, k_scaled_t: Tensor, z64: Tensor, den: Tensor, num: Tensor,
                   present: Tensor | None = None) -> Tensor:
    """s(q K~^T) Z num / den for the newest query: (H, dh) float32."""
    logits = masked(torch.matmul(q.unsqueeze(1), k_scaled_t), present)
    probs = torch.softmax(logits, dim=-1).to(F64)                                       # (H, 1, m)
    c = torch.matmul(probs, z64) / den.unsqueeze(1)
    return torch.matmul(c, num).squeeze(1).to(torch.float32)


def retroactive_output(q_ring: Tensor, k_scaled_t: Tensor, z64: Tensor, den: Tensor, num: Tensor,
                       present: Tensor | None = None) -> Tensor:
    """s(Q K~^T) (Z num / den) for every ring slot's query: (H, n, dh) float32, the torch step's
    factors (its cached s(q_i K~^T) rows equal these: same queries, same landmarks)."""
    p = torch.softmax(masked(torch.matmul(q_ring, k_scaled_t), present), dim=-1)        # (H, n, m)
    zw = torch.matmul(z64, num / den.unsqueeze(-1)).to(torch.float32)                   # (H, m, dh)
    return torch.matmul(p, zw)


def landmark_output(graph, q: Tensor, q_ring: Tensor, k_scaled_t: Tensor, z64: Tensor, den: Tensor,
                    num: Tensor, present: Tensor | None = None) -> Tensor:
    """The newest query's Nyström output (H, dh), or every slot's (H, n, dh) when retroactive."""
    if graph.retroactive:
        return retroactive_output(q_ring, k_scaled_t, z64, den, num, present)
    return nystrom_output(q, k_scaled_t, z64, den, num, present)


class FixedNystromGraph(StreamGraph):
    """Continual Nyström SDA with fixed (k-means) landmarks: the m rows of s(Q~ K^T) V as running
    sums; a step costs O(m dh) per head, plus a row recomputed when it went stale."""

    kind = "continual_nystrom/fixed"

    def __init__(self, model, block: int = 0):
        super().__init__(model, block)
        attn = self.attn
        if not bool(attn.has_fixed):
            raise NotExportable("this model's fixed landmarks are not fitted")
        self.m = attn.num_landmarks
        ql, kl = attn.fixed_q_land.detach(), attn.fixed_k_land.detach()
        self.register_buffer("q_scaled", (ql * self.scale).contiguous())
        self.register_buffer("k_scaled_t", (kl * self.scale).transpose(1, 2).contiguous())
        self.register_buffer("z64", landmark_pinv(ql, kl, attn.pinv_iters).contiguous().to(F64))

    def state_spec(self) -> list[StateTensor]:
        return self.spec(self.H, self.n, self.dh, self.m, self.retroactive)

    @staticmethod
    def spec(H: int, n: int, dh: int, m: int, retroactive: bool) -> list[StateTensor]:
        queries = [StateTensor("q_ring", (H, n, dh), torch.float32)] if retroactive else []
        return queries + [StateTensor("v_ring", (H, n, dh), torch.float32),
                          StateTensor("key_scores", (H, n, m), torch.float32),
                          StateTensor("ref", (H, m), F64), StateTensor("den", (H, m), F64),
                          StateTensor("num", (H, m, dh), F64), StateTensor("peak", (H, m), F64)]

    def attend(self, t, q, k, v, *state):
        state = self.fresh(t, list(state))
        q_ring = None
        if self.retroactive:
            q_ring, *state = state
            q_ring = torch.where(self.slot_mask(t).view(1, -1, 1), q.unsqueeze(1), q_ring)
        v_ring, key_scores, ref, den, num, peak = state
        ref = torch.where(t == 0, ref.new_full((), float("-inf")), ref)
        here = self.slot_mask(t)
        v_ring, key_scores, ref, den, num, peak = slide(
            here, t >= self.n, torch.matmul(self.q_scaled, k.unsqueeze(-1)).squeeze(-1), v,
            v_ring, key_scores, ref, den, num, peak)
        ref, den, num, peak, stale = refresh(self.slots < t + 1, key_scores, v_ring, ref, den, num, peak,
                                             masked=self.masked)
        a = landmark_output(self, q, q_ring, self.k_scaled_t, self.z64, den, num)
        events = torch.stack([stale.new_zeros(()), stale.new_zeros(()), stale])
        queries = [q_ring] if self.retroactive else []
        return (a, events, *queries, v_ring, key_scores, ref, den, num, peak)


def slide(here: Tensor, full: Tensor, scores: Tensor, v: Tensor, v_ring, key_scores, ref, den,
          num, peak):
    """The departing key (if the window is full) leaves every row with the score it was added
    with, the newest key joins (running-max rescale first), its scores are cached.
    here: (n,) the slot; scores: (H, R) float32 of the newest key against the R rows; v: (H, dh);
    key_scores (H, n, R); the rows' sums in their dtype (float64 Nyström rows, float32
    retroactive rows)."""
    dt = ref.dtype
    slot = torch.argmax(here.to(torch.int64)).view(1)
    gone_scores = torch.index_select(key_scores, 1, slot).squeeze(1)                 # (H, R)
    gone_v = torch.index_select(v_ring, 1, slot).squeeze(1)                          # (H, dh)
    e = torch.where(full, torch.exp(gone_scores.to(dt) - ref), ref.new_zeros(()))
    den = den - e
    num = num - e.unsqueeze(-1) * gone_v.to(dt).unsqueeze(1)
    v_ring = torch.where(here.view(1, -1, 1), v.unsqueeze(1), v_ring)
    key_scores = torch.where(here.view(1, -1, 1), scores.unsqueeze(1), key_scores)
    s = scores.to(dt)
    top = torch.maximum(ref, s)
    factor = torch.exp(ref - top)                        # 1 where the reference stays
    den, peak, num, ref = den * factor, peak * factor, num * factor.unsqueeze(-1), top
    e = torch.exp(s - ref)
    den = den + e
    num = num + e.unsqueeze(-1) * v.to(dt).unsqueeze(1)
    return v_ring, key_scores, ref, den, num, torch.maximum(peak, den)


def refresh(valid: Tensor, key_scores: Tensor, v_ring: Tensor, ref, den, num, peak, rows=None,
            masked: bool = False):
    """Rows whose denominator fell below TAU * peak (cancellation), recomputed from their cached
    scores over the valid slots; an ONNX If, taken only when a row is stale. ``rows``: (R,) the
    rows that may be (default all). Returns the rows' sums and how many were recomputed."""
    stale = den < TAU * peak
    if rows is not None:
        stale = stale & rows.view(1, -1)

    def recompute(valid, key_scores, v_ring, ref, den, num, peak, stale):
        r, d, nm = fresh_rows(key_scores.transpose(1, 2), valid, v_ring, ref.dtype)
        return dense(torch.where(stale, r, ref), torch.where(stale, d, den),
                     torch.where(stale.unsqueeze(-1), nm, num), torch.where(stale, d, peak))

    def keep(valid, key_scores, v_ring, ref, den, num, peak, stale):
        return dense(ref, den, num, peak)

    out = branch(stale.any(), recompute, keep, (valid, key_scores, v_ring, ref, den, num, peak, stale), masked)
    return (*out, stale.sum().to(torch.int64))
