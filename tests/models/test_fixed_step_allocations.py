"""The steady continual Nyström step (torch reference path) allocates nothing but its output; with
fixed landmarks it does no work that grows with n.

Oracle: a TorchDispatchMode sees every aten operation of a step; an output whose storage is not
one of the inputs' storages is a fresh allocation.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from models.sda import streaming_sda


class AllocationCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.fresh, self.ops = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.fresh.append((str(func), tuple(t.shape)))
        return out


def steady_fixed_stream(n, heads=16, d=12, m=4, seed=0, mode="fixed"):
    g = torch.Generator().manual_seed(seed)
    fixed = (torch.randn(heads, m, d, generator=g), torch.randn(heads, m, d, generator=g))
    s = streaming_sda("continual_nystrom", n, num_landmarks=m, landmark_mode=mode,
                     fixed_landmarks=fixed if mode == "fixed" else None)
    s.reset(heads)
    xs = torch.randn(n + 50, 3, heads, d, generator=g)
    for i in range(n + 40):
        s.step(xs[i, 0], xs[i, 1], xs[i, 2])
    return s, xs[n + 40:]


def test_steady_step_allocates_only_its_output():
    for n, mode in ((30, "fixed"), (480, "fixed"), (120, "continual")):
        s, xs = steady_fixed_stream(n, mode=mode)
        for i, x in enumerate(xs):
            if mode == "continual" and (s.st.t + 1) % (n // 4) == 0:
                s.step(x[0], x[1], x[2])     # a landmark update step: allowed to allocate
                continue
            counter = AllocationCounter()
            with counter:
                out = s.step(x[0], x[1], x[2])
            assert s.report.rows_refreshed == 0
            # the float64 sums give a float64 product, cast to the output: one allocation
            assert [shape for _, shape in counter.fresh] == [(16, 12)], counter.fresh
            assert out.shape == (16, 12)


def test_fixed_step_does_the_same_operations_at_every_window_size():
    counts = {}
    for n in (30, 120, 1920):
        s, xs = steady_fixed_stream(n)
        counter = AllocationCounter()
        with counter:
            s.step(xs[0, 0], xs[0, 1], xs[0, 2])
        counts[n] = counter.ops
    assert len(set(counts.values())) == 1, counts
