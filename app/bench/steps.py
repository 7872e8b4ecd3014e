"""`python main.py bench`: per-step latency of every attention variant and model, measured.

Batch 1, after warm-up (the window is full), median and p95 over many steps, next to torch's own
nn.TransformerEncoderLayer recomputing the whole window. Results go to stdout and to a Markdown
and a JSON file. Numbers are measurements of this machine, never constants.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from app.runtime.records import percentile
from audio.files import atomic_write_json, atomic_write_text
from models import flops as F
from models.paper import PAPER_TABLE_II

from .attention import bench_models, bench_sda, bench_stability, matmul_peak, peak_for
from .timing import Row, time_steps, warm


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


MUSICNN_PATHS = {"compiled": "continual, the push as one graph compiled ahead of time (the app's)",
                 "graph": "continual, the push as one graph, eager",
                 "batch": "continual, the batched form with one slot (MusicnnBatch)",
                 "recompute": "recomputing the 3 s patch"}


def bench_musicnn(steps: int, budget: float) -> list[Row]:
    """Per-hop cost of the musicnn front end on real-shaped input (the demo signal): streaming
    log-mel, and the network by each path of MUSICNN_PATHS: the app's (GraphStream with its
    compiled pushes, built first where missing), the same graph eager, the batched form with
    one slot (what one CUDA stream runs), and recomputing the whole 3 s patch; with the FLOPs of
    each (2 x multiply-accumulates, from the formula the tests check), the ratios measured in the
    same run, and the app's real-time factor. The paths alternate hop by hop and are checked equal on the timed hops. The heap is
    set as the engine sets it (``Engine.warm``: app/runtime/memory.py), so that a hop's large
    temporaries reuse memory as they do in the app."""
    from app.runtime.memory import many_streams_heap
    from audio.musicnn import build_musicnn
    from audio.musicnn.graph import STEADY_FRAMES, CompiledPushes, GraphStream
    from audio.musicnn.mel import StreamingMel
    from audio.musicnn.batch import MusicnnBatch
    from audio.sources import DemoSource

    hops = [h for _, h in zip(range(64), DemoSource(seed=0))]
    mel = StreamingMel()
    frames = [mel.push(h) for h in hops]
    net, checksum = build_musicnn()
    rows = []
    many_streams_heap()
    mel2, i = StreamingMel(), [0]

    def mel_step():
        mel2.push(hops[i[0] % 64])
        i[0] += 1
    mel_med, mel_p95 = time_steps(mel_step, steps, budget)
    rows.append(Row(0, "front end: musicnn log-mel per hop", mel_med, mel_p95))
    pushes = CompiledPushes("MSD_musicnn", checksum, STEADY_FRAMES)   # built first where missing
    pushes.wait()
    labels = dict(MUSICNN_PATHS)
    if pushes.status != "compiled":
        labels["compiled"] = f"continual, the push as one graph compiled ahead of time: not here, so eager ({pushes.status})"
    # The paths alternate hop by hop, so all see the same machine load (timings here move by
    # +-30 % between runs; the ratio of medians taken this way is stable).
    streams = {"compiled": GraphStream(net, pushes), "graph": GraphStream(net),
               "batch": OneSlot(MusicnnBatch(net, 1)), "recompute": Recomputed(net)}
    times = {p: [] for p in streams}
    macs = {}
    worst, deadline = 0.0, time.perf_counter() + 4 * budget
    for j in range(min(steps, 400)):
        outs = {}
        for p, stream in streams.items():
            t0 = time.perf_counter()
            outs[p] = stream.push(frames[j % 64])
            times[p].append(time.perf_counter() - t0)
            macs[p] = stream.last_macs
        worst = max(worst, max(float((outs[p] - outs["recompute"]).abs().max()) for p in streams))
        if time.perf_counter() > deadline and j >= 30:
            break
    med = {}
    for p in streams:
        ts = times[p][8:]                                   # after the first-call costs
        med[p] = statistics.median(ts) * 1e6
        rows.append(Row(0, f"front end: musicnn network per hop, {labels[p]}", med[p],
                        percentile(ts, 0.95) * 1e6, 2 * macs[p]))
    app, batch, full = med["compiled"], med["batch"], med["recompute"]
    rows.append(Row(0, f"front end: musicnn, the app's continual network: {batch / app:.2f}x faster than the "
                       f"batched form with one slot (the hop with its log-mel: {(batch + mel_med) / (app + mel_med):.2f}x), "
                       f"{full / app:.2f}x faster than recomputing at {macs['recompute'] / macs['compiled']:.2f}x the "
                       f"FLOPs; max |taggram diff| {worst:.1e}; real-time factor {app / 250e3:.3f}", app, app))
    return rows


class OneSlot:
    """A MusicnnBatch's slot 0 pushed as one stream: ``push(frames) -> (50,)``, ``last_macs``."""

    def __init__(self, batch):
        self.batch = batch
        batch.reset(0)

    def push(self, frames):
        taggram = self.batch.push([0], [frames])[0]
        self.last_macs = int(self.batch.macs[0])
        return taggram


class Recomputed:
    """The reference network on the newest 187 frames (silence before), every hop in full."""

    def __init__(self, net):
        from audio.musicnn import BANDS, PATCH_FRAMES, patch_macs
        self.net, self.patch, self.last_macs = net, torch.zeros(1, PATCH_FRAMES, BANDS), patch_macs()

    @torch.no_grad()
    def push(self, frames):
        self.patch = torch.cat([self.patch, torch.as_tensor(frames)[None]], dim=1)[:, -self.patch.shape[1]:]
        return self.net(self.patch)[0]


def first_token_seconds() -> float:
    """A fresh process: seconds from the source starting to the first token (models loaded first)."""
    import subprocess
    import sys
    code = ("import time; from audio.frontends import build_frontend; from audio.sources import DemoSource;"
            "from audio.tokens.stream import TokenStream; e = build_frontend('musicnn');"
            "t0 = time.perf_counter(); next(iter(TokenStream(DemoSource(realtime=True), e)));"
            "print(time.perf_counter() - t0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[2]))
    return float(out.stdout.strip().splitlines()[-1])


def format_table(rows: list[Row]) -> str:
    """Markdown: latency, FLOPs, achieved GFLOP/s next to the matrix-product peak for the same
    FLOPs, and speed-ups measured in this run (vs torch's recompute of the window; fused vs the
    torch reference path of the same variant): a model row's are paired (the two timed in
    alternating blocks), the SDA rows' a ratio of their medians."""
    lines = ["| n | what | median us | p95 us | FLOPs/step | GFLOP/s | matmul peak GFLOP/s, same FLOPs "
             "| vs torch recompute | fused vs torch path |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_name = {(r.n, r.what): r.median_us for r in rows}
    for r in rows:
        speed = fused = ""
        if "vs_recompute" in r.extra:                 # paired, see attention.bench_models
            speed = f"{r.extra['vs_recompute']:.1f}x"
        if "vs_torch_path" in r.extra:
            fused = f"{r.extra['vs_torch_path']:.1f}x"
        elif r.what.endswith(" (fused)"):
            ref = by_name.get((r.n, r.what[:-len(" (fused)")] + " (torch)"))
            fused = f"{ref / r.median_us:.1f}x" if ref else ""
        fl = f"{r.flops:,}" if r.flops is not None else ""
        gf = f"{r.flops / (r.median_us * 1e3):.2f}" if r.flops else ""
        peak = r.extra.get("peak_gflops")
        pk = f"{peak:.1f}" if peak else ""
        lines.append(f"| {r.n} | {r.what} | {r.median_us:,.1f} | {r.p95_us:,.1f} | {fl} | {gf} | {pk} "
                     f"| {speed} | {fused} |")
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
        frontends=("musicnn", "vggish"), frontend_only: bool = False, only: str = "") -> dict:
    """Every row for every n in ``windows``; ``only``: just the attention rows whose name contains
    it (no front-end or stability rows). Returns the run's data (``attention_markdown`` renders it)."""
    if threads:
        torch.set_num_threads(threads)
    rows: list[Row] = []
    for n in () if frontend_only else windows:
        print(f"[bench] n = {n} ...", flush=True)
        rows += bench_sda(n, steps, budget_s, only=only)
        rows += bench_models(n, steps, budget_s, only=only)
    stability = (bench_stability(120, min(steps, 3000), budget_s)
                 if 120 in windows and not frontend_only and not only else [])
    peak_for(rows + stability)
    frontends = () if only else frontends
    frontend = ((bench_musicnn(steps, budget_s) if "musicnn" in frontends else [])
                + (bench_frontend(steps, budget_s) if "vggish" in frontends else []))
    data = {"rows": [r.__dict__ for r in rows], "frontend": [r.__dict__ for r in frontend],
            "stability": [r.__dict__ for r in stability], "threads": torch.get_num_threads(),
            "torch": torch.__version__, "big_peak_gflops": matmul_peak(2 * 512 ** 3),
            "first_token_s": first_token_seconds() if frontends else None}
    text = "# Nystream benchmark\n\n" + attention_markdown(data)
    print(text)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    atomic_write_json(out.with_suffix(".json"), data)
    print(f"[bench] wrote {out} and {out.with_suffix('.json')}")
    return data


def attention_markdown(data: dict) -> str:
    """The tables of one ``run``'s data (also the benchmark page's section)."""
    rows = [Row(**r) for r in data["rows"]]
    frontend = [Row(**r) for r in data["frontend"]]
    stability = [Row(**r) for r in data["stability"]]
    text = (f"{data['threads']} torch threads, torch {data['torch']}; FLOPs are means over the timed "
            f"steps (landmark cycles averaged); a 512^3 matrix product reaches "
            f"{data['big_peak_gflops']:.0f} GFLOP/s here.\n\n")
    if rows:
        text += format_table(rows)
    if frontend:
        text += ("\n\n### Audio front ends (batch 1, per hop)\n\n" + format_table(frontend).replace("| 0 |", "| - |")
                 + f"\n\nFirst token {data['first_token_s']:.2f} s after a real-time source starts, in a "
                 f"fresh process (the musicnn front end loaded before; the hop itself takes 0.25 s).")
    if stability:
        text += ("\n\n### Cost of each stability measure (n = 120, mean FLOPs per step)\n\n"
                 + format_table(stability))
    return text + "\n\n### Table II of the Continual Nyström paper (SDA FLOPs per step)\n\n" + paper_table() + "\n"
