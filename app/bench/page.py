"""The benchmark page, written by `bench` itself: ``bench ... --page`` stores its run's numbers as
``docs/benchmarks/<kind>.json`` (with the command, the date and the machine) and rewrites
``docs/benchmarks.md`` from every stored run. Nobody edits the numbers by hand; a new run of a
kind replaces its section.

The machine is named by its cores, its CPU and a speed index: the median step of torch's 1-layer
encoder recomputing a window of n = 120 (d = 192, 16 heads) on one torch thread, timed in a fresh
process at the end of each run. The code is named by its git commit (marked when tracked files
outside docs/ differ from it; absent outside a checkout).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "docs" / "benchmarks"
PAGE = ROOT / "docs" / "benchmarks.md"


def speed_index_ms() -> float:
    """Median ms of torch's 1-layer encoder step at n = 120 on one torch thread, timed in a fresh
    process (nothing a benchmark left running in this one takes part): the machine's speed index."""
    code = ("import torch; torch.set_num_threads(1)\n"
            "from app.bench.attention import torch_encoder\n"
            "from app.bench.timing import time_steps\n"
            "print(time_steps(torch_encoder(120, 1), 400, 2.0)[0] / 1e3)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"the speed index could not be measured: {r.stderr[-500:]}")
    return float(r.stdout.split()[-1])


def machine() -> dict:
    import torch
    gpu = {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}
    return {"cores": os.cpu_count(), "cpu": cpu_name(), "torch": torch.__version__,
            "speed_index_ms": round(speed_index_ms(), 3), **gpu}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str | None:
    """The checkout's commit, short, with " and changes" when tracked files outside docs/ (which
    the bench itself rewrites) differ from it; None outside a git checkout (an installed wheel)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=7", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" and changes" if changed else "")


def record(kind: str, data, argv=None, store: Path = STORE, page: Path = PAGE) -> Path:
    """Store one run of ``kind`` and rewrite the page; returns the page's path."""
    entry = {"kind": kind, "command": "python main.py " + " ".join(sys.argv[1:] if argv is None else argv),
             "date": datetime.date.today().isoformat(), "machine": machine(), "commit": commit(), "data": data}
    store.mkdir(parents=True, exist_ok=True)
    tmp = store / f".{kind}.json.tmp"
    tmp.write_text(json.dumps(entry, indent=1, allow_nan=True) + "\n")
    os.replace(tmp, store / f"{kind}.json")
    text = render(store)
    tmp = page.with_name(f".{page.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, page)
    print(f"[bench] stored docs/benchmarks/{kind}.json and rewrote {page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}")
    return page


def stored(store: Path = STORE) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(store.glob("*.json"))}


def provenance(e: dict) -> str:
    m = e["machine"]
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    code = f", code at commit {e['commit']}" if e.get("commit") else ""
    return (f"*`{e['command']}`, {e['date']}{code}, {m['cores']} cores ({m['cpu']}){gpu}, torch {m['torch']}, "
            f"speed index {m['speed_index_ms']:.2f} ms (torch's 1-layer encoder step at n = 120, one thread).*")


def render(store: Path = STORE) -> str:
    runs = stored(store)
    parts = [HEADER]
    for title, kinds, intro, body in SECTIONS:
        if isinstance(kinds, str):                     # a prefix: every stored run whose name has it
            kinds = sorted((k for k in runs if k.startswith(kinds)), key=lambda k: (k.count("-"), k))
        present = [k for k in kinds if k in runs]
        if not present:
            continue
        parts.append(f"## {title}\n\n{intro}\n")
        parts.append(body({k: runs[k] for k in present}))
    design = store / "design.md"                       # one-off timings behind choices in the code
    if design.exists():
        parts.append("\n" + design.read_text())
    return "\n".join(parts).rstrip() + "\n"


# ---------------------------------------------------------------------- sections
HEADER = """# Benchmarks

Written by `python main.py bench ... --page` from the runs stored in `docs/benchmarks/*.json`;
each section names the command, the date and the machine of its run. Timings on a shared machine
move by +-30 % between runs: compare ratios within one run, and FLOPs, which do not move. A
machine's speed index is the median step of torch's 1-layer encoder at n = 120 on one thread,
timed in a fresh process after the run; a host with twice the index runs every row about twice
as slow.
"""


def attention_body(runs: dict) -> str:
    from .steps import attention_markdown
    e = runs["attention"]
    return provenance(e) + "\n\n" + attention_markdown(e["data"]) + "\n"


GUI_RUNS = {"gui-quiet": "nothing else running", "gui-hogs2": "both cores busy (2 CPU hogs)",
            "gui-quiet-cold": "nothing else running, empty caches", "gui-hogs2-cold": "2 CPU hogs, empty caches"}


def gui_body(runs: dict) -> str:
    from app.gui.bench import FIRST_HOP_GOAL_S
    cols = [k for k in GUI_RUNS if k in runs]
    lines = ["| | " + " | ".join(GUI_RUNS[k] for k in cols) + " | goal |",
             "| --- | " + " | ".join("---:" for _ in cols) + " | --- |"]

    def row(label, fn, goal=""):
        lines.append(f"| {label} | " + " | ".join("-" if not runs[k]["data"]["hops"] else fn(runs[k]["data"])
                                                 for k in cols) + f" | {goal} |")
    lines.append("| hops shown / dropped | " + " | ".join(
        f"{runs[k]['data']['hops']} / {runs[k]['data'].get('dropped_hops', '-')}" for k in cols) + " | 0 dropped |")
    row("end-to-end delay median / p95 (ms)", lambda r: f"{r['delay_ms_median']:.0f} / {r['delay_ms_p95']:.0f}",
        "p95 <= 100 quiet, 200 with two hogs")
    row("real-time factor (engine process)", lambda r: f"{r['rtf']:.2f}", "<= 0.3 with two hogs")
    lines.append("| the engine process ready after the window opened (s) | " + " | ".join(
        "-" if runs[k]["data"].get("prepared_s") is None else f"{runs[k]['data']['prepared_s']:.2f}"
        for k in cols) + " | |")
    lines.append("| first hop after Start (s) | " + " | ".join(
        "none" if runs[k]["data"].get("first_hop_s") is None else f"{runs[k]['data']['first_hop_s']:.2f}"
        for k in cols) + f" | <= {FIRST_HOP_GOAL_S[True]:g} empty caches, <= {FIRST_HOP_GOAL_S[False]:g} warm |")
    row("the musicnn push at the end", lambda r: r.get("push") or "-")
    row("the models' steady steps at the end", lambda r: r.get("kernels") or "-")
    row("frame time median / p95 (ms)", lambda r: f"{r['frame_ms_median']:.1f} / {r['frame_ms_p95']:.1f}",
        "median <= 12")
    row("window thread CPU per frame, painting included, median / p95 (ms)",
        lambda r: f"{r['frame_cpu_ms']['median']:.1f} / {r['frame_cpu_ms']['p95']:.1f}")
    for panel in ("genre", "cost", "spectrogram", "ranking", "table"):
        row(f"panel `{panel}` median (ms), frames drawn",
            lambda r, p=panel: ("-" if not r["panel_ms"][p]["frames"] else
                                f"{r['panel_ms'][p]['median']:.2f}, {r['panel_ms'][p]['frames']}"))
    runs_text = "\n".join(f"- {GUI_RUNS[k]}: " + provenance(runs[k]) for k in cols)
    return runs_text + "\n\n" + "\n".join(lines) + "\n"


def soak_body(runs: dict) -> str:
    e = runs["soak"]
    r = e["data"]
    lines = [provenance(e), "",
             f"{r['hops']} hops shown, {r['dropped_hops']} dropped; delay median {r['delay_ms_median']:.0f} ms, "
             f"p95 {r['delay_ms_p95']:.0f} ms, worst 10-s p95 {r['delay_ms_worst_p95']:.0f} ms; real-time "
             f"factor {r['rtf']:.2f}; {r['hogs']} CPU hogs beside it.", "",
             "| minute | window process RSS (MB) | engine process RSS (MB) |", "| ---: | ---: | ---: |"]
    shown = -1
    for i, ((t, mb), (_, emb)) in enumerate(zip(r["rss_mb"], r["engine_rss_mb"])):
        if t // 300 > shown or i == len(r["rss_mb"]) - 1:
            shown = t // 300
            lines.append(f"| {t / 60:.1f} | {mb:.0f} | {emb:.0f} |")
    for who, key in (("window", "rss_growth_after_5min_mb"), ("engine", "engine_rss_growth_after_5min_mb")):
        g = r.get(key)
        lines.append("")
        lines.append(f"Growth of the {who} process after the first 5 minutes: "
                     + ("run 10 minutes or more to see it." if g is None else f"{g:+.1f} MB (goal < 20 MB)."))
    return "\n".join(lines) + "\n"


def control_body(runs: dict) -> str:
    e = runs["control"]
    r = e["data"]
    return (provenance(e) + "\n\n"
            f"| calls | hops | dropped | k-means fits | errors | control ms before a hop: median / p95 / max |\n"
            f"| ---: | ---: | ---: | ---: | ---: | --- |\n"
            f"| {r['calls']} | {r['hops']} | {r['dropped_hops']} | {r['fits']} | {len(r['errors'])} | "
            f"{r['control_ms_median']:.2f} / {r['control_ms_p95']:.2f} / {r['control_ms_max']:.2f} |\n")


def scale_body(runs: dict) -> str:
    from .scale import scale_table
    e = runs["scale"]
    r = e["data"]
    lines = [provenance(e), "", f"{r['tracks']} tracks, {r['frontend']}, {r['cpus']} CPUs; starting the local "
             f"Ray instance took {r['ray_startup_s']:.1f} s (not in the times).", ""] + scale_table(r)
    return "\n".join(lines) + "\n"


def evaluate_body(runs: dict) -> str:
    e = runs["evaluate"]
    r = e["data"]
    return (provenance(e) + "\n\n"
            f"{r['sequences']} sequences x {r['steps']} steps x {r['models']} checkpoints streamed, with the "
            f"batch-forward agreement and the batch-1 cost streams, in {r['seconds']:.1f} s on "
            f"{r['threads']} threads (goal < 120 s).\n")


def onnx_body(runs: dict) -> str:
    from .onnx import onnx_table
    e = runs["onnx"]
    rows = e["data"]["rows"]

    def spans(blocks: int) -> str:
        of = [r for r in rows if r.get("blocks", 1) == blocks]
        if not of:
            return ""
        slower = [r["onnx"]["median_us"] / r["fused"]["median_us"] for r in of]
        faster = [r["torch"]["median_us"] / r["onnx"]["median_us"] for r in of]
        nodes = [r["nodes"] for r in of if "nodes" in r]
        dispatch = f", dispatching {min(nodes)} to {max(nodes)} nodes a step" if nodes else ""
        return (f"with {'one block' if blocks == 1 else 'two blocks'}, it took {min(slower):.1f} to "
                f"{max(slower):.1f} times the fused step's time and ran {min(faster):.2f} to "
                f"{max(faster):.2f} times as fast as the torch step{dispatch}")
    said = "; ".join(x for x in (spans(1), spans(2)) if x)
    return (provenance(e) + "\n\n" + "\n".join(onnx_table(e["data"])) + "\n\n"
            f"In this run of ONNX Runtime, {said}. Why: the exported graph is functional, so each step "
            "writes every state tensor anew (a ring write is a `Where` over all n slots, O(n d) memory "
            "per ring and step, where the fused step writes one slot in place, O(d)) and dispatches "
            "every node of its top level, plus the `If` branches it takes, at about a microsecond each; "
            "the fused step is one compiled call on state it updates in place. The continual-landmark "
            "graph carries three rings and the cached scores, so its copies grow with n and it is the "
            "slowest 1-block graph at n = 120. With two blocks the step is mostly block 0's "
            "out-projection and feed-forward over all n tokens (large matrix products, the same in "
            "every path), so the per-node cost weighs less and ONNX Runtime comes closer to the fused "
            "step. The exported file pays for portability (C++, mobile, the browser, no Python), not "
            "for speed on this CPU.\n")


def engines_body(runs: dict) -> str:
    from .engines import engines_table
    return provenance(runs["engines"]) + "\n\n" + engines_table(runs["engines"]["data"])


def streams_body(runs: dict) -> str:
    from .frontend_modes import modes_table
    from .streams import capacity_text, step_table, streams_table, streams_why, tensor_table
    out = []
    for kind, e in runs.items():
        r = e["data"]
        out += [provenance(e), "", f"{r['device']}, {r['threads']} threads; {r['frontend']} and "
                f"{', '.join(r['models'])}; {r['hops']} timed hops per row"
                + (f", after {r['warm']} hops of warm-up (every model in its steady step; on CUDA every graph "
                   f"captured)" if "warm" in r else "")
                + "; matmul peak "
                f"{r['peak_gflops']:.1f} GFLOP/s; resident memory per added stream {r['mb_per_stream']:.1f} MB ({r.get('mb_per_stream_from', 'between the last two rows')}; "
                f"{'each row in a fresh process' if r.get('fresh_processes') else 'the rows one after another in one process'}).", ""]
        out += streams_table(r) + ["", f"Real-time capacity: **{capacity_text(r)}** ({r['device']}). "
                                   + (streams_why(r) if "frontend_flops_per_stream_hop" in r["rows"][-1] else ""), ""]
        if "tensor" in r:
            models = "the model's step" if len(r["models"]) == 1 else f"the {len(r['models'])} models' steps"
            out += ["The hop's batched tensor work alone (the musicnn network's push of 15 or 16 log-mel "
                    f"frames per stream, {models}, the probabilities copied back; no audio, "
                    "log-mel or records):", ""] + tensor_table(r) + [
                    "", f"Tensor work within 125 ms: **{capacity_text(r['tensor'])}** ({r['device']}).", ""]
        if "precision_error" in r:
            from audio.musicnn import PRECISION_WORDS
            e = r["precision_error"]
            out += [f"{PRECISION_WORDS[e['precision']]} against float32 ({e['streams']} streams through both, "
                    f"{e['sources']}; {e['steps']} model steps): taggrams differ by at most {e['taggram_max_abs']:.1e}, the "
                    f"models' probabilities by {e['probability_max_abs']:.1e}; the top genre differs in "
                    f"{100 * e['top_differs']:.2f} % of the steps, and {e['verdicts_changed']} of {e['verdicts']} "
                    f"verdicts change.", ""]
        if "frontend_modes" in r:
            out += ["The musicnn network's push alone, by which temporal branches keep accumulators "
                    "(audio/musicnn/batch.py; 15 or 16 random log-mel frames per stream"
                    + (", the three ways taking turns hop by hop in one process" if r["device"] == "cpu" else
                       ", one way after another") + "):", ""] \
                + modes_table(r["frontend_modes"], r["device"], r["precision"]) + [""]
        if "steps" in r:
            out += ["One stream's model step past warm-up (median):", ""] + step_table(r) + [""]
    return "\n".join(out) + "\n"


def ray_line(x: dict, goal: float) -> str:
    ok = x["latency_ms_p95"] <= goal and x["dropped"] == 0
    from .serve import ray_label
    return (f" On {ray_label(x)}: **{'yes' if ok else 'no'}**; its "
            f"{x['compared_records']} records' probabilities differ from the one server's by at most "
            f"{x['max_probability_difference']:.1e} ({x['server_processes']} processes in the server's tree).")


def serve_body(runs: dict) -> str:
    from .serve import GOAL_P95_MS, plain_label, ray_label, roles_line, serve_table
    out = []
    for kind, e in sorted(runs.items(), key=lambda kv: kv[1]["data"]["clients"]):
        r = e["data"]
        ok = r["latency_ms_p95"] <= GOAL_P95_MS and r["dropped"] == 0
        delay = f"; the server's batch delay {r['batch_delay_ms']:g} ms" if "batch_delay_ms" in r else ""
        out += [provenance(e), "", f"{r['clients']} clients, {r['audio']}, {r['seconds']:g} s of audio each; "
                f"server resident {r['server_rss_mb']:.0f} MB at the end{delay}.", ""]
        out += serve_table(r) + ["", f"Real time (p95 at most {GOAL_P95_MS:g} ms, nothing dropped): "
                                     f"**{'yes' if ok else 'no'}**."
                                 + (ray_line(r["ray"], GOAL_P95_MS) if "ray" in r else ""), ""]
        for label, x in [(plain_label(r), r)] + ([(ray_label(r["ray"]), r["ray"])] if "ray" in r else []):
            if roles_line(x):
                out += [f"{label}: {roles_line(x)}.", ""]
    return "\n".join(out) + "\n"


SECTIONS = [
    ("Attention and model steps", ["attention"],
     "Per-step latency, batch 1, CPU, window full, of every variant's SDA (16 heads of d = 12 folded "
     "into the batch, single-output, m = 4) and of 1- and 2-block models, beside torch's "
     "`nn.TransformerEncoder` recomputing the window. (fused): the compiled CPU step, the default from "
     "Python and in the app; (torch): the reference path. GFLOP/s achieved sits next to what one "
     "`torch.mm` of the same FLOPs reaches on the machine. Model rows' speed-ups are paired: the two "
     "steps are timed in alternating blocks so that both see the same load. Then the audio front ends "
     "per hop, the cost of the numerical stabilisation, and the paper's Table II in its convention.",
     attention_body),
    ("The live window", list(GUI_RUNS),
     "`bench --gui SECONDS [--hogs N] [--cold]`: the real window (offscreen) on the real-time demo signal with six "
     "models (the five shipped musicnn models and an untrained 2-block continual Nyström); the engine "
     "(source, front end, models) runs in its own process, the window only draws. Delay: from a hop's "
     "last sample to its result drawn. The window starts its engine process when it opens (the front "
     "end built, the compiled forms loaded or their build started); the bench presses Start once it is "
     "ready. First hop: from Start (the models built) to the first hop drawn. `--cold`: the engine "
     "process's caches are empty folders, a fresh install (the compiled forms build in the background "
     "while the torch step and the eager push serve). The musicnn push and the models' steady steps: "
     "how the engine's one stream ran them at the end (compiled, or not yet and why; docs/front-ends.md). "
     "Frame time: the window thread's work on a frame with new hops "
     "(plots at most 20 frames a second; ranking, table and status bar once a second; hidden panels "
     "skipped); the CPU line adds Qt's painting of that frame. `--hogs 2` runs two busy-looping "
     "processes beside it, a laptop whose cores are busy.",
     gui_body),
    ("A long run in the window", ["soak"],
     "`bench --soak SECONDS`: the same run, long, with the resident memory of both processes sampled "
     "every 10 s; memory must stay flat after the first 5 minutes.",
     soak_body),
    ("Live control under load", ["control"],
     "`bench --control SECONDS`: the real-time demo signal through musicnn into the four variants at the "
     "paper's size while another thread makes 100 control calls a second (six live k-means fits and six "
     "model builds every 4 s, landmark switches, resets). Control applied before a hop has a 20 ms budget.",
     control_body),
    ("Extraction beyond one process", ["scale"],
     "`bench --scale DIR`: `extract` of the GTZAN-named files in DIR in one process, then on a local Ray "
     "instance with 1 and 2 workers.",
     scale_body),
    ("The exported step (ONNX Runtime)", ["onnx"],
     "`bench --onnx`: each model's step exported by `main.py export` and run by ONNX Runtime (CPU "
     "execution provider, one thread, batch 1), beside the torch reference step and the fused step of the "
     "same model (one thread), window full; FLOPs per step of the whole model (all three compute the same "
     "step); the file's size. The shipped trained musicnn models and untrained models of the papers' size, "
     "with 1 and 2 blocks.",
     onnx_body),
    ("The front end by inference engine", ["engines"],
     "`bench --engines`: the candidates for compiling the musicnn front end, each running the same float32 "
     "module: torch eager (what the app runs for many streams), `torch.compile` (inductor; one stream in the app "
     "runs the push graph built ahead of time by the same compiler, AOTInductor: docs/front-ends.md), ONNX Runtime (exported by "
     "`torch.onnx.export(dynamo=True)`) and OpenVINO (the same export; not a dependency of the app: "
     "`pip install openvino`, 2026.4.1 is a 59 MB wheel and 180 MB installed). The parts: the network "
     "recomputing its 3 s patch; its head (mid-end and back-end over the patch's 561 front-end channels, "
     "which the continual push recomputes every hop); the continual push's timbral rows of 16 new frames "
     "(its largest matrix product); the whole continual push of a hop of 16 new frames as one graph "
     "(`audio/musicnn/graph.py` `PushGraph`: the caches in patch order in, the caches and taggrams out; eager, it computes "
     "the app's push, bit for bit at one stream, and its differences are from that push's taggrams). S streams computed at "
     "once, each part and S in a fresh process; the engines take turns in blocks of calls.",
     engines_body),
    ("Many streams in one engine", "streams-",
     "`bench --streams [--device cpu|cuda] [--precision float32|tf32|bf16] [--models NAME,...] [--streams-from S]`: S demo streams "
     "(seeds 0..S-1) in one engine, S = 1, 2, 4, ... (or from S, halving while that is over) "
     "until the p95 hop passes half a hop (125 ms), then S halving the gap between the last two until it is "
     "at most an eighth of the lower (each S in a fresh process), timed past every model's warm-up. A hop: every stream's "
     "audio and sample frames, their log-mels in one call on the network's device (audio/musicnn/mel.py), the "
     "musicnn network once for all streams (audio/musicnn/batch.py, each stream's continual caches in a slot), "
     "then each of the five shipped models (or those named) stepped once for all streams (models/stream/batch.py; on the CPU the "
     "continual ones step their steady streams in one call of the compiled backend). FLOPs per stream-hop: the front end's and the five models' "
     "(the formulas of the single-stream steps); GFLOP/s against one float32 `torch.mm` (2 x 512^3 FLOPs on "
     "the CPU, 2 x 8192^3 on CUDA, TF32 off also for a `--precision tf32` run). A row's resident memory is what the engine and its streams added to the "
     "process; a run that says *held* reads it after the heap's free memory is given back to the system "
     "(glibc malloc_trim), with the memory before beside it (up to 64 MB of free heap are kept for the next "
     "hop's temporaries). Memory per added stream: the median of the slopes between every two rows from half "
     "the largest S up (each run says how it measured). "
     "The capacity is the largest S whose p95 hop is at most 125 ms. Three more "
     "tables say where a hop's time goes: its batched tensor work alone, the musicnn network's push by "
     "which of its temporal branches keep accumulators, and one stream's model step "
     "(on CUDA: the batch's step for one stream, without and with its CUDA graph).",
     streams_body),
    ("Serving clients over WebSocket", "serve-",
     "`bench --serve N [--serve-processes K] [--replicas K] [--batch-delay-ms D]`: the real `serve` command (musicnn "
     "and the five shipped models, the server's batch delay as each run says; on the CPU its "
     "engine in lanes, one per core, or with `--serve-processes K` as `serve --processes K`, K one-lane processes "
     "behind one socket: docs/serve.md) in its own "
     "process, and N WebSocket clients on loopback in the bench's process, each streaming real audio "
     "(the shared GTZAN excerpts) in real time, one 0.25 s hop per message. Latency: from a hop's last "
     "sample sent to its record received. Server CPU (cores, /proc) and resident memory per stream; the "
     "server's cores by process (its workers, or its Ray Serve replicas, proxy, controller and Ray's own servers), the "
     "clients' (the bench's process), the streams an engine hop took, and how the streams were split over "
     "the lanes, workers or replicas at the busiest moment (the server's health), where a run has them. The clients "
     "run on the same cores as the server. With `--replicas K`, the same clients and audio "
     "then against `serve --ray local --replicas K`, a fresh local Ray (the edge spreads the streams over "
     "the K replicas' own ports; each replica may take every client). The server takes up to N streams "
     "from one address. CPU and memory are summed over the server's process tree.",
     serve_body),
    ("Evaluation speed", ["evaluate"],
     "`bench --evaluate`: `evaluate` on 300 synthetic sequences x 120 steps x 6 checkpoints.",
     evaluate_body),
]
