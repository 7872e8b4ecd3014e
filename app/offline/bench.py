"""`python main.py bench`: per-step latency of every attention variant and model, measured.

Batch 1, after warm-up (the window is full), median and p95 over many steps, next to torch's own
nn.TransformerEncoderLayer recomputing the whole window. Results go to stdout and to a Markdown
and a JSON file. Numbers are measurements of this machine, never constants.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.runtime.records import percentile
from models import flops as F
from models.landmarks import fit_fixed_landmarks
from models.paper import PAPER_TABLE_II
from models.sda import streaming_sda
from models.training import with_config
from models.transformer import ModelConfig, build_model

SDA_CASES = [("regular", None), ("continual", None), ("nystrom", "segment"),
             ("continual_nystrom", "continual"), ("continual_nystrom", "fixed")]


@dataclass
class Row:
    n: int
    what: str
    median_us: float
    p95_us: float
    flops: int | None = None
    extra: dict = field(default_factory=dict)


def time_steps(fn, steps: int, budget_s: float) -> tuple[float, float]:
    """Median and p95 of ``fn()`` in microseconds, at most ``steps`` calls or ``budget_s``."""
    times = []
    deadline = time.perf_counter() + budget_s
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline and len(times) >= 10:
            break
    return statistics.median(times) * 1e6, percentile(times, 0.95) * 1e6


def warm(fn, count: int) -> None:
    """Run ``fn`` ``count`` times, unbudgeted: every timed step must see a full window."""
    for _ in range(count):
        fn()


def bench_sda(n: int, steps: int, budget: float, heads: int = 16, d_head: int = 12, m: int = 4) -> list[Row]:
    rows = []
    g = torch.Generator().manual_seed(0)
    stream = torch.randn(64, 3, heads, d_head, generator=g)
    for variant, mode in SDA_CASES:
        fixed = ((torch.randn(heads, m, d_head, generator=g), torch.randn(heads, m, d_head, generator=g))
                 if mode == "fixed" else None)
        s = streaming_sda(variant, n, num_landmarks=m if "nystrom" in variant else None,
                         landmark_mode=mode, fixed_landmarks=fixed)
        s.reset(heads)
        i = [0]

        def step():
            x = stream[i[0] % 64]
            i[0] += 1
            s.step(x[0], x[1], x[2])

        warm(step, n + 20)               # fill the window
        med, p95 = time_steps(step, steps, budget)
        rows.append(Row(n, f"SDA {variant}" + (f"/{mode}" if mode else ""), med, p95, s.last_step_flops))
    return rows


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
    """Cost of the stabilisation: amortised latency and FLOPs with and without it, on unit-scale
    scores and on scores swinging to ~260 (where the unstabilised sums are wrong or NaN)."""
    rows = []
    g = torch.Generator().manual_seed(1)
    fixed = (torch.randn(heads, m, d_head, generator=g), torch.randn(heads, m, d_head, generator=g))
    cases = [("continual", None, True), ("continual_nystrom", "continual", False),
             ("continual_nystrom", "fixed", False), ("continual_nystrom", "fixed", True)]
    data = {"unit": torch.randn(steps + n + 20, 3, heads, d_head, generator=g),
            "stress": stress_stream(steps + n + 20, heads, d_head)}
    for variant, mode, retro in cases:
        for kind, xs in data.items():
            for stabilize in (True, False):
                s = streaming_sda(variant, n, retroactive=retro, stabilize=stabilize,
                                 num_landmarks=m if "nystrom" in variant else None,
                                 landmark_mode=mode, fixed_landmarks=fixed if mode == "fixed" else None)
                s.reset(heads)
                i = [0]
                flops = []

                def step():
                    x = xs[i[0]]
                    i[0] += 1
                    s.step(x[0], x[1], x[2])
                    flops.append(s.last_step_flops)

                warm(step, n + 20)
                flops.clear()
                med, p95 = time_steps(step, min(steps, xs.shape[0] - n - 20), budget)
                name = (f"SDA {variant}" + (f"/{mode}" if mode else "") + (" retro" if retro else "")
                        + f", {kind} scores, " + ("stabilised" if stabilize else "unstabilised"))
                rows.append(Row(n, name, med, p95, round(sum(flops) / len(flops))))
    return rows


def bench_frontend(steps: int, budget: float) -> list[Row]:
    """Per-hop latency of the log-mel front end and of VGGish (batch 1), and the real-time factor.
    VGGish weights do not change its cost, so a seeded random VGGish is timed."""
    from audio.melspec import StreamingLogMel
    from audio.sources import DemoSource
    from audio.vggish import build_embedder

    hops = [h for _, h in zip(range(64), DemoSource(seed=0))]
    rows = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        embedder = build_embedder(random_seed=0, device=device)
        logmel = StreamingLogMel()
        i = [0]
        patch = [logmel.push(hops[0])]

        def front():
            patch[0] = logmel.push(hops[i[0] % 64])
            i[0] += 1

        def vgg():
            embedder(patch[0][None])
            if device == "cuda":
                torch.cuda.synchronize()

        def both():
            front()
            vgg()

        warm(both, 5)
        if device == "cpu":
            rows.append(Row(0, "front end: log-mel per hop", *time_steps(front, steps, budget)))
        rows.append(Row(0, f"front end: VGGish per hop ({device})", *time_steps(vgg, min(steps, 500), budget)))
        med, p95 = time_steps(both, min(steps, 500), budget)
        rows.append(Row(0, f"front end: log-mel + VGGish per hop ({device}), real-time factor "
                           f"{med / 250e3:.3f}", med, p95))
    return rows


def bench_musicnn(steps: int, budget: float) -> list[Row]:
    """Per-hop cost of the musicnn front end on real-shaped input (the demo signal): streaming
    log-mel, the continual network and the same network recomputing the whole 3 s patch, with
    the FLOPs of each (2 x multiply-accumulates, from the formula the tests check), their ratio
    measured in the same run, and the continual front end's real-time factor. The two network
    paths are checked equal on the timed hops."""
    from audio.musicnn import build_musicnn
    from audio.musicnn_mel import StreamingMel
    from audio.musicnn_stream import MusicnnStream
    from audio.sources import DemoSource

    hops = [h for _, h in zip(range(64), DemoSource(seed=0))]
    mel = StreamingMel()
    frames = [mel.push(h) for h in hops]
    net, _ = build_musicnn()
    rows = []
    mel2, i = StreamingMel(), [0]

    def mel_step():
        mel2.push(hops[i[0] % 64])
        i[0] += 1
    rows.append(Row(0, "front end: musicnn log-mel per hop", *time_steps(mel_step, steps, budget)))
    # The two paths alternate hop by hop, so both see the same machine load (timings here move
    # by +-30 % between runs; the ratio of medians taken this way is stable).
    streams = {c: MusicnnStream(net, continual=c) for c in (True, False)}
    times = {True: [], False: []}
    macs = {}
    worst, deadline = 0.0, time.perf_counter() + 2 * budget
    for j in range(min(steps, 400)):
        outs = {}
        for c, stream in streams.items():
            t0 = time.perf_counter()
            outs[c] = stream.push(frames[j % 64])
            times[c].append(time.perf_counter() - t0)
            macs[c] = stream.last_macs
        worst = max(worst, float((outs[True] - outs[False]).abs().max()))
        if time.perf_counter() > deadline and j >= 30:
            break
    result = {}
    for c in (True, False):
        ts = times[c][8:]                                   # after the first-call costs
        med, p95 = statistics.median(ts) * 1e6, percentile(ts, 0.95) * 1e6
        result[c] = (med, 2 * macs[c])
        what = "continual (cached and updated branches)" if c else "recomputing the 3 s patch"
        rows.append(Row(0, f"front end: musicnn network per hop, {what}", med, p95, 2 * macs[c]))
    (mc, fc), (mr, fr) = result[True], result[False]
    rows.append(Row(0, f"front end: musicnn continual vs recompute: {mr / mc:.2f}x faster, "
                       f"{fr / fc:.2f}x fewer FLOPs, max |taggram diff| {worst:.1e}; real-time "
                       f"factor {mc / 250e3:.3f}", mc, mc))
    return rows


def first_token_seconds() -> float:
    """A fresh process: seconds from the source starting to the first token (models loaded first)."""
    import subprocess
    import sys
    code = ("import time; from audio.frontends import build_frontend; from audio.sources import DemoSource;"
            "from audio.token_stream import TokenStream; e = build_frontend('musicnn');"
            "t0 = time.perf_counter(); next(iter(TokenStream(DemoSource(realtime=True), e)));"
            "print(time.perf_counter() - t0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[2]))
    return float(out.stdout.strip().splitlines()[-1])


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


def bench_models(n: int, steps: int, budget: float) -> list[Row]:
    rows = []
    tokens = torch.randn(64, 1, 128)
    for layers in (1, 2):
        for variant, mode in SDA_CASES:
            model = make_model(variant, mode, layers, n)
            model.reset(1)
            i = [0]

            def step():
                model.step(tokens[i[0] % 64])
                i[0] += 1

            warm(step, n + 20)
            med, p95 = time_steps(step, steps, budget)
            rows.append(Row(n, f"model {layers}-block {model.cfg.table_row}",
                            med, p95, model.step_flops()["model"]))
        # torch's encoder layer(s) recomputing the window: the reference point
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
        med, p95 = time_steps(recompute, steps, budget)
        rows.append(Row(n, f"torch TransformerEncoder {layers}-layer recompute", med, p95))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| n | what | median us | p95 us | FLOPs/step | speed-up vs torch recompute |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    ref = {}
    for r in rows:
        if r.what.startswith("torch"):
            ref[(r.n, r.what.split()[2])] = r.median_us
    for r in rows:
        speed = ""
        if r.what.startswith("model"):
            base = ref.get((r.n, r.what.split()[1].replace("block", "layer")))
            speed = f"{base / r.median_us:.1f}x" if base else ""
        fl = f"{r.flops:,}" if r.flops is not None else ""
        lines.append(f"| {r.n} | {r.what} | {r.median_us:,.0f} | {r.p95_us:,.0f} | {fl} | {speed} |")
    return "\n".join(lines)


def paper_table() -> str:
    ours = F.paper_table_ii()
    lines = ["| SDA variant (d=192, n=120, m=4, one head) | paper | ours, paper convention | ratio |",
             "| --- | ---: | ---: | ---: |"]
    for key, paper in PAPER_TABLE_II.items():
        lines.append(f"| {key} | {paper / 1e6:.3f}M | {ours[key] / 1e6:.4f}M | {ours[key] / paper:.3f} |")
    return "\n".join(lines)


def run(windows=(30, 120, 480, 1920), steps: int = 2000, budget_s: float = 6.0,
        out: str | Path = "bench_results/bench.md", threads: int | None = None,
        frontends=("musicnn", "vggish"), frontend_only: bool = False) -> list[Row]:
    if threads:
        torch.set_num_threads(threads)
    rows: list[Row] = []
    for n in () if frontend_only else windows:
        print(f"[bench] n = {n} ...", flush=True)
        rows += bench_sda(n, steps, budget_s)
        rows += bench_models(n, steps, budget_s)
    stability = (bench_stability(120, min(steps, 3000), budget_s)
                 if 120 in windows and not frontend_only else [])
    frontend = ((bench_musicnn(steps, budget_s) if "musicnn" in frontends else [])
                + (bench_frontend(steps, budget_s) if "vggish" in frontends else []))
    first = first_token_seconds()
    table = format_table(rows)
    header = (f"# Nystream benchmark\n\nPer-step latency, batch 1, CPU, {torch.get_num_threads()} "
              f"threads, torch {torch.__version__}, {platform.processor() or platform.machine()}. "
              f"SDA rows: 16 heads of d=12 folded into the batch, single-output, m=4.\n\n")
    table += ("\n\n## Audio front end (batch 1)\n\n" + format_table(frontend).replace("| 0 |", "| - |")
              + f"\n\nFirst token {first:.2f} s after a real-time source starts, in a fresh process "
              f"(the musicnn front end loaded before; the hop itself takes 0.25 s).")
    rows += frontend
    if stability:
        table += ("\n\n## Cost of the numerical stabilisation (n = 120, amortised FLOPs per step)\n\n"
                  + format_table(stability))
        rows += stability
    text = header + table + "\n\n## Table II of the Continual Nyström paper (SDA FLOPs per step)\n\n" + paper_table() + "\n"
    print(text)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    print(f"[bench] wrote {out} and {out.with_suffix('.json')}")
    return rows
