"""The attention rows of `bench`: SDA kernels and whole model steps, torch reference and fused
(compiled) paths, torch's encoder recomputing the window, the cost of each stability measure, and
this machine's matrix-product peak for the same FLOPs. Every ratio is taken within one run.
"""
from __future__ import annotations

import torch

from models.fused import available as fused_available
from models.landmarks import fit_fixed_landmarks
from models.stream.sums import Stability
from .sda import streaming_sda
from app.offline.training import with_config
from models.transformer import ModelConfig, build_model

from .timing import Row, paired_medians, time_steps, warm

SDA_CASES = [("regular", None), ("continual", None), ("nystrom", "segment"),
             ("continual_nystrom", "continual"), ("continual_nystrom", "fixed")]
CONTINUAL = ("continual", "continual_nystrom")


def has_fused(variant: str) -> bool:
    """Continual kernels and models have a fused step; a recomputing ``nystrom`` kernel or model
    a compiled pseudo-inverse."""
    return fused_available() and (variant in CONTINUAL or variant == "nystrom")


def paths(variant: str) -> list[bool]:
    """fused=False (torch reference) always; fused=True too where it exists."""
    return [False, True] if has_fused(variant) else [False]


def label(fused: bool, variant: str) -> str:
    if not has_fused(variant):
        return ""
    return " (fused)" if fused else " (torch)"


def sda_stream(heads: int, d: int, count: int = 64, seed: int = 0) -> list[tuple]:
    """Pre-split q, k, v per step (the harness's indexing stays out of the timed step)."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(x.clone() for x in s) for s in torch.randn(count, 3, heads, d, generator=g)]


def bench_sda(n: int, steps: int, budget: float, heads: int = 16, d_head: int = 12, m: int = 4,
              only: str = "") -> list[Row]:
    rows = []
    stream = sda_stream(heads, d_head)
    g = torch.Generator().manual_seed(0)
    fixed = (torch.randn(heads, m, d_head, generator=g), torch.randn(heads, m, d_head, generator=g))
    for variant, mode in SDA_CASES:
        for fused in paths(variant):
            name = f"SDA {variant}" + (f"/{mode}" if mode else "") + label(fused, variant)
            if only not in name:
                continue
            s = streaming_sda(variant, n, num_landmarks=m if "nystrom" in variant else None,
                              landmark_mode=mode, fixed_landmarks=fixed if mode == "fixed" else None,
                              fused=fused)
            s.reset(heads)
            i, flops = [0], []

            def step():
                s.step(*stream[i[0] % 64])
                i[0] += 1

            warm(step, n + 20)               # fill the window
            med, p95 = time_steps(step, steps, budget, lambda: flops.append(s.last_step_flops))
            rows.append(Row(n, name, med, p95, round(sum(flops) / len(flops))))
    return rows


def make_model(variant: str, mode: str | None, layers: int, n: int) -> torch.nn.Module:
    """An untrained model (seed 0); fixed landmarks fitted on random tokens."""
    cfg = ModelConfig(variant=variant, layers=layers, window=n, num_landmarks=4,
                      landmark_mode="fixed" if mode == "fixed" else None)
    model = build_model(cfg.replace(landmark_mode=None), seed=0).eval()
    if mode == "fixed":
        g = torch.Generator().manual_seed(0)
        fit_fixed_landmarks(model, torch.randn(8, min(n, 120), cfg.in_dim, generator=g), max_tokens=2000)
        model = with_config(model, cfg).eval()
    return model


def bench_models(n: int, steps: int, budget: float, only: str = "") -> list[Row]:
    """Model steps (mean FLOPs over the timed steps, so a landmark cycle is averaged); ``only``:
    just the rows whose name contains it. Each row's speed-ups are paired: the model step timed
    in alternating blocks with torch's encoder recomputing the window (``vs_recompute``) and, for
    a fused row, with the same model on the torch path (``vs_torch_path``)."""
    rows = []
    tokens = [torch.randn(1, 128) for _ in range(64)]
    for layers in (1, 2):
        encoder = torch_encoder(n, layers)
        for variant, mode in SDA_CASES:
            row = ModelConfig(variant=variant, landmark_mode="fixed" if mode == "fixed" else None).table_row
            steppers = {}
            for fused in paths(variant):
                name = f"model {layers}-block {row}{label(fused, variant)}"
                if only not in name:
                    continue
                model = make_model(variant, mode, layers, n).use_fused(fused)
                model.reset(1)
                step = steppers[fused] = stepper(model, tokens)
                warm(step, n + 20)
                flops = []
                med, p95 = time_steps(step, steps, budget,
                                      lambda: flops.append(model.step_flops()["model"]))
                extra = {"vs_recompute": ratio(*paired_medians(step, encoder, budget))}
                if fused and False in steppers:
                    extra["vs_torch_path"] = ratio(*paired_medians(step, steppers[False], budget,
                                                                   block_b=10))
                rows.append(Row(n, name, med, p95, round(sum(flops) / len(flops)), extra=extra))
        if only in f"torch TransformerEncoder {layers}-layer recompute":
            med, p95 = time_steps(encoder, steps, budget)
            rows.append(Row(n, f"torch TransformerEncoder {layers}-layer recompute", med, p95,
                            regular_flops(n, layers)))
    return rows


def stepper(model, tokens: list) -> callable:
    """One streamed step of ``model`` per call, cycling through ``tokens``."""
    i = [0]

    def step():
        model.step(tokens[i[0] % len(tokens)])
        i[0] += 1
    return step


def ratio(model_us: float, reference_us: float) -> float:
    """How many times faster the model step is than the reference, both paired medians."""
    return reference_us / model_us


def torch_encoder(n: int, layers: int) -> callable:
    """torch's encoder layer(s) recomputing the window, warmed up: the reference point (its
    FLOPs are a ``regular`` model's of the same shape, ``regular_flops``)."""
    torch.manual_seed(0)
    embed = torch.nn.Linear(128, 192)
    enc = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(192, 16, 384, dropout=0.1, batch_first=True),
        num_layers=layers, enable_nested_tensor=False).eval()
    head = torch.nn.Linear(192, 10)
    window = torch.randn(1, n, 128)

    @torch.no_grad()
    def recompute():
        head(enc(embed(window))[:, -1])

    warm(recompute, 5)
    return recompute


def regular_flops(n: int, layers: int) -> int:
    """FLOPs of one step of a ``regular`` model (the whole window recomputed)."""
    regular = make_model("regular", None, layers, n)
    regular.reset(1)
    for _ in range(n):
        regular.step(torch.zeros(1, 128))
    return regular.step_flops()["model"]


def matmul_peak(flops: int, budget: float = 0.3) -> float:
    """GFLOP/s of this machine's BLAS (torch.mm) on one square product with about ``flops``
    FLOPs (a x a by a x a, 2a^3 = flops): the best a single call of that size achieves."""
    a = max(1, round((flops / 2) ** (1 / 3)))
    x, y, out = torch.randn(a, a), torch.randn(a, a), torch.empty(a, a)
    med, _ = time_steps(lambda: torch.mm(x, y, out=out), 2000, budget)
    return 2 * a ** 3 / (med * 1e3)


def stress_stream(steps: int, heads: int, d: int, peak: float = 260.0, seed: int = 0) -> torch.Tensor:
    """(steps, 3, heads, d) q, k, v whose scores q.k/sqrt(d) swing up to ~peak and back."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(steps, dtype=torch.float32)
    env = (0.02 + 0.98 * (0.5 + 0.5 * torch.sin(2 * torch.pi * t / 613)) ** 2).sqrt()
    unit = torch.nn.functional.normalize(torch.randn(steps, 2, heads, d, generator=g), dim=-1)
    qk = unit * (env * peak ** 0.5 * d ** 0.25 * 1.6)[:, None, None, None]
    return torch.cat([qk, torch.randn(steps, 1, heads, d, generator=g)], dim=1)


def bench_stability(n: int, steps: int, budget: float, heads: int = 16, d_head: int = 12,
                    m: int = 4) -> list[Row]:
    """What each stability measure costs (continual Nyström, single-output, n = 120): FLOPs and
    latency with every measure off, then adding the running-max rescale, the stale-row refresh
    and the float64 sums, on unit-scale scores and on scores swinging to ~260."""
    rows = []
    g = torch.Generator().manual_seed(1)
    fixed = (torch.randn(heads, m, d_head, generator=g), torch.randn(heads, m, d_head, generator=g))
    total = steps + n + 20
    data = {"unit": torch.randn(total, 3, heads, d_head, generator=g),
            "stress": stress_stream(total, heads, d_head)}
    measures = [("no measure", Stability(False, False, False)),
                ("rescale", Stability(True, False, False)),
                ("rescale + refresh", Stability(True, True, False)),
                ("rescale + refresh + float64 sums", Stability(True, True, True))]
    for mode in ("continual", "fixed"):
        for kind, xs in data.items():
            stream = [tuple(x.clone() for x in s) for s in xs]
            for what, stab in measures:
                for fused in ([False, True] if stab.wide and fused_available() else [False]):
                    s = streaming_sda("continual_nystrom", n, stabilize=stab, num_landmarks=m,
                                      landmark_mode=mode, fixed_landmarks=fixed, fused=fused)
                    s.reset(heads)
                    i, flops, bad, out = [0], [], [0], [None]

                    def step():
                        out[0] = s.step(*stream[i[0]])
                        i[0] += 1

                    def check():
                        flops.append(s.last_step_flops)
                        bad[0] += not bool(torch.isfinite(out[0]).all())

                    warm(step, n + 20)
                    med, p95 = time_steps(step, min(steps, total - n - 20), budget, check)
                    rows.append(Row(n, f"SDA continual_nystrom/{mode}, {kind} scores, {what}"
                                       + label(fused, "continual"), med, p95,
                                    round(sum(flops) / len(flops)),
                                    extra={"non-finite steps": bad[0]}))
    return rows


def peak_for(rows: list[Row]) -> None:
    """Fill each row's matrix-product peak for its FLOPs (measured once per size)."""
    seen: dict[int, float] = {}
    for r in rows:
        if r.flops:
            a = max(1, round((r.flops / 2) ** (1 / 3)))
            if a not in seen:
                seen[a] = matmul_peak(r.flops)
            r.extra["peak_gflops"] = seen[a]
