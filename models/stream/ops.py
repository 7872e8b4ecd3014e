"""Small helpers of the streaming step (models/stream/): state specs, per-stream masks and the
rare events as branches.

Shapes: S streams (the leading axis of every state tensor and input), H heads, n the window,
dh the head width; t (S,) int64 is each stream's position (the 0-based index of the token it
steps now).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

F64 = torch.float64
EVENTS = ("eager", "cond", "masked")


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of one stream: its name, shape (without the stream axis) and dtype."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def cast(x: Tensor, dtype) -> Tensor:
    """x in ``dtype`` (itself when it is: a no-op ``to`` still costs a dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)


def zeros(spec: list[StateTensor], streams: int, device=None) -> list[Tensor]:
    """Zero state for ``streams`` streams: (streams, *shape) per tensor of ``spec``."""
    return [torch.zeros((streams, *s.shape), dtype=s.dtype, device=device) for s in spec]


def per_stream(x: Tensor, like: Tensor) -> Tensor:
    """(S,) or (S, k) values viewed to broadcast against ``like`` (S, ...), trailing axes 1
    beyond the second: (S, n) masks against (S, H, n, dh) rings put n on the third axis."""
    if x.dim() == 1:
        return x.view(-1, *([1] * (like.dim() - 1)))
    return x.view(x.shape[0], 1, x.shape[1], *([1] * (like.dim() - 3)))


def fresh(t: Tensor, state: list[Tensor], events: str, inf: tuple[int, ...] = ()) -> list[Tensor]:
    """At position 0 a stream's state is zeros (and -inf for the running maxima at ``inf``)
    whatever its slot held: a slot left by another stream needs no clearing. ("eager": nothing
    to do when no stream starts, a host read.)"""
    start = t == 0
    if events == "eager" and not bool(start.any()):
        return list(state)
    out = []
    for i, s in enumerate(state):
        value = s.new_full((), float("-inf")) if i in inf else s.new_zeros(())
        out.append(torch.where(per_stream(start, s), value, s))
    return out


def slot_of(t: Tensor, slots: Tensor) -> Tensor:
    """(S, n) True at the ring slot t % n each stream's token takes."""
    return slots.view(1, -1) == (t % slots.shape[0]).view(-1, 1)


def filled(t: Tensor, slots: Tensor) -> Tensor:
    """(S, n) the slots that hold a token once token t is written (min(t + 1, n) of them)."""
    return slots.view(1, -1) < (t + 1).view(-1, 1)


def write(here: Tensor, x: Tensor, ring: Tensor) -> Tensor:
    """``ring`` (S, H, n, dh) with x (S, H, dh) at each stream's slot ``here`` (S, n)."""
    return torch.where(here.view(here.shape[0], 1, -1, 1), x.unsqueeze(2), ring)


def take(ring: Tensor, here: Tensor) -> Tensor:
    """Each stream's row at its slot ``here`` (S, n): ring (S, H, n, ...) -> (S, H, ...)."""
    index = torch.argmax(here.to(torch.int64), dim=1)                     # (S,)
    shape = (ring.shape[0], ring.shape[1], 1, *ring.shape[3:])
    return torch.gather(ring, 2, index.view(-1, 1, 1, *([1] * (ring.dim() - 3))).expand(shape)).squeeze(2)


def dense(*xs: Tensor) -> tuple[Tensor, ...]:
    """Branch outputs as new, contiguous tensors: torch.cond needs both branches' strides to
    agree and no output to alias an input (x + 0 is x, -inf included, and never an alias; a mask
    is x or False, ONNX adds no masks)."""
    return tuple((torch.logical_or(x.reshape(-1), x.new_zeros(())) if x.dtype == torch.bool
                  else x.reshape(-1) + x.new_zeros(())).reshape(x.shape) for x in xs)


def flatten(items: tuple) -> tuple[list[Tensor], list]:
    """Tensors and NamedTuples of tensors -> the tensors, and how to rebuild the items."""
    leaves, shape = [], []
    for x in items:
        if isinstance(x, tuple):
            leaves.extend(x)
            shape.append((type(x), len(x)))
        else:
            leaves.append(x)
            shape.append(None)
    return leaves, shape


def unflatten(leaves, shape: list) -> tuple:
    """``flatten``'s items again."""
    out, i = [], 0
    for kind in shape:
        if kind is None:
            out.append(leaves[i])
            i += 1
        else:
            out.append(kind[0](*leaves[i:i + kind[1]]))
            i += kind[1]
    return tuple(out)


def cond(pred: Tensor, yes, no, operands: tuple, returns: tuple | None) -> tuple:
    """``torch.cond`` of branches that take and return tensors and NamedTuples of tensors (its
    operands and outputs are flat tensors: flattened here, rebuilt for the branches and after).
    ``returns``: per output, None (a tensor) or its NamedTuple class (None: every output a tensor)."""
    leaves, shape = flatten(operands)

    def flat(fn):
        return lambda *xs: dense(*flatten(fn(*unflatten(xs, shape)))[0])
    out = torch.cond(pred, flat(yes), flat(no), tuple(leaves))
    if returns is None:
        return tuple(out)
    return unflatten(out, [None if kind is None else (kind, len(kind._fields)) for kind in returns])


def branch(pred: Tensor, yes, no, operands: tuple, events: str, returns: tuple | None = None) -> tuple:
    """A rare event that ``yes`` handles per stream with masks (``no``: nothing happens), ``pred``
    () true when any stream has it: "eager" a Python branch on its value (a host read), "cond"
    ``torch.cond`` (an ONNX If), "masked" ``yes`` always (exact for every stream; no host read,
    as CUDA graphs need). Operands and outputs: tensors and NamedTuples of tensors, ``returns``
    as ``cond`` says."""
    if events == "masked":
        return yes(*operands)
    if events == "cond":
        return cond(pred, yes, no, operands, returns)
    return yes(*operands) if bool(pred) else no(*operands)


def select(mask: Tensor, yes, no, operands: tuple, events: str, returns: tuple | None = None) -> tuple:
    """Per stream, ``yes``'s outputs where ``mask`` (S,) holds, else ``no``'s. "masked": both
    and a select; "cond": one stream, ``torch.cond``; "eager": only the branch every stream
    takes when they agree (a host read), else both. Operands and outputs as ``branch``'s (an
    output both branches hand on unchanged is not selected)."""
    if events == "cond":
        if mask.shape[0] != 1:
            raise ValueError("a torch.cond step takes one stream")
        return cond(mask[0], yes, no, operands, returns)
    if events == "eager":
        if bool(mask.all()):
            return yes(*operands)
        if not bool(mask.any()):
            return no(*operands)
    (a, shape), (b, _) = flatten(yes(*operands)), flatten(no(*operands))
    return unflatten([x if x is y else torch.where(per_stream(mask, x), x, y) for x, y in zip(a, b)], shape)
