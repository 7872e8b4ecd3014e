"""`python main.py bench`: per-step latency and FLOPs of every variant against torch's recompute
(app/bench/steps.py); `--gui` the live window (app/gui/bench.py); `--control` a control storm on a
live stream (app/bench/control.py); `--evaluate` evaluation speed; `--onnx` the exported
step against the torch and fused steps (app/bench/onnx.py); `--streams` many streams in one
engine (app/bench/streams.py); `--engines` musicnn's dense parts by inference engine
(app/bench/engines.py)."""
from __future__ import annotations

from . import command, error
from .argtypes import (POSITIVE, SECONDS, add_device_arguments, compute_device, integer, number, window_list,
                       writable_path)


def add_arguments(p) -> None:
    p.add_argument("--windows", default="30,120,480,1920", type=window_list, help="comma-separated n values")
    p.add_argument("--steps", type=POSITIVE, default=2000, help="timed steps per row (max)")
    p.add_argument("--budget", type=SECONDS, default=6.0, help="seconds per row (max)")
    p.add_argument("--threads", type=POSITIVE, default=None, help="torch CPU threads")
    p.add_argument("--out", default="bench_results/bench.md", type=writable_path, help="Markdown output (JSON beside)")
    p.add_argument("--gui", type=SECONDS, metavar="SECONDS",
                   help="instead: the live window with 6 models on the demo signal for SECONDS")
    p.add_argument("--soak", type=SECONDS, metavar="SECONDS",
                   help="instead: the --gui run for SECONDS (e.g. 3600), with resident memory every 10 s")
    p.add_argument("--hogs", type=integer(0, 16), default=0, metavar="N",
                   help="with --gui / --soak: N busy-looping processes run beside the window")
    p.add_argument("--cold", action="store_true",
                   help="with --gui: the engine process starts with empty caches (numba's, the compiled push's), "
                        "as on a fresh install")
    p.add_argument("--page", action="store_true",
                   help="store this run in docs/benchmarks/ and rewrite docs/benchmarks.md from every stored run")
    p.add_argument("--control", type=SECONDS, metavar="SECONDS",
                   help="instead: a storm of 100 control calls a second (live k-means fits, model adds) "
                        "on the real-time stream for SECONDS; dropped hops and control time per hop")
    p.add_argument("--scale", metavar="DIR",
                   help="instead: extract the GTZAN-named files in DIR in one process and on a local "
                        "Ray instance with 1 and 2 workers; tracks per minute, start-up, worker memory")
    p.add_argument("--onnx", action="store_true",
                   help="instead: the exported step (ONNX Runtime) vs the torch and fused steps of the same models")
    p.add_argument("--streams", action="store_true",
                   help="instead: S = 1, 2, 4, ... demo streams in one engine (musicnn and the shipped "
                        "models) until the p95 hop passes 125 ms; the real-time capacity")
    add_device_arguments(p, "with --streams: where it runs")
    p.add_argument("--models", type=lambda v: [m for m in v.split(",") if m], default=None, metavar="NAME[,NAME]",
                   help="with --streams: only these shipped models, e.g. 'continual_nystrom' (default: all five)")
    p.add_argument("--streams-from", type=POSITIVE, default=1, metavar="S",
                   help="with --streams: double from S streams, not 1 (a large device's small rows take long and say little)")
    p.add_argument("--streams-to", type=POSITIVE, default=None, metavar="S",
                   help="with --streams: stop doubling past S streams (a quick look at small batches: "
                        "no front-end ways table; stored apart, as streams-...-toS)")
    p.add_argument("--serve", type=POSITIVE, metavar="N",
                   help="instead: N WebSocket clients streaming real audio in real time to `serve` on "
                        "loopback; latency, dropped hops, server CPU and memory per stream")
    p.add_argument("--serve-seconds", type=SECONDS, default=20.0, help="with --serve: audio per client")
    p.add_argument("--replicas", type=POSITIVE, metavar="K",
                   help="with --serve: then the same clients against K replicas on a local Ray Serve, "
                        "their results compared with the one server's")
    p.add_argument("--batch-delay-ms", type=number(0, 1000), default=None, metavar="MS",
                   help="with --serve: the server's `serve --batch-delay-ms` (default: serve's own)")
    p.add_argument("--serve-processes", type=POSITIVE, default=1, metavar="K",
                   help="with --serve: the server as `serve --processes K` (default: 1, one process)")
    p.add_argument("--engines", action="store_true",
                   help="instead: musicnn's dense parts (the recomputed network, its head, the push's timbral "
                        "rows) at 1, 4, 16 and 32 streams by torch, torch.compile, ONNX Runtime and OpenVINO "
                        "(when installed)")
    p.add_argument("--evaluate", action="store_true",
                   help="instead: time `evaluate` on 300 sequences x 120 steps x 6 models")
    p.add_argument("--vggish-weights", help="VGGish weights for --gui (default: random)")
    p.add_argument("--frontend", choices=("musicnn", "vggish", "all"), default="all",
                   help="front end(s) whose per-hop cost is measured (--gui: musicnn unless vggish)")
    p.add_argument("--frontend-only", action="store_true", help="only the front-end rows")
    p.add_argument("--only", default="", metavar="TEXT",
                   help="only the attention rows whose name contains TEXT, e.g. "
                        "'continual_nystrom/fixed' (default: every row)")


def print_gui(r: dict) -> None:
    from app.gui.bench import FIRST_HOP_GOAL_S
    busy = f", {r['hogs']} CPU hogs beside it" if r["hogs"] else ", nothing else running"
    caches = "empty caches" if r.get("cold") else "caches as they are"
    ready = ("not ready within the wait" if r.get("prepared_s") is None else
             f"ready {r['prepared_s']:.2f} s after the window opened")
    if not r["hops"]:
        print(f"GUI: no hop within {r['seconds']:.0f} s of Start ({r['cores']} cores{busy}; {caches}; "
              f"engine process {ready})")
        return
    print(f"GUI, {r['models']} models on the real-time demo signal for {r['seconds']:.0f} s "
          f"({r['hops']} hops, {r['frontend']}; {r['cores']} cores{busy}):")
    print(f"  frame time (frames with new hops): median {r['frame_ms_median']:.1f} ms, "
          f"p95 {r['frame_ms_p95']:.1f} ms, max {r['frame_ms_max']:.1f} ms (goal: median <= 12 ms)")
    c = r["frame_cpu_ms"]
    print(f"    with Qt's painting: window thread CPU per such frame, median {c['median']:.1f} ms, "
          f"p95 {c['p95']:.1f} ms")
    for name, q in r["panel_ms"].items():
        print(f"    {name:<12} median {q['median']:5.2f} ms, p95 {q['p95']:5.2f} ms over {q['frames']} frames")
    goal = 200 if r["hogs"] >= 2 else 100
    print(f"  end-to-end delay, hop's last sample -> drawn: median {r['delay_ms_median']:.0f} ms, "
          f"p95 {r['delay_ms_p95']:.0f} ms (goal <= {goal} ms)")
    print(f"  real-time factor {r['rtf']:.2f} (engine process); dropped hops {r['dropped_hops']}")
    goal = FIRST_HOP_GOAL_S[bool(r.get("cold"))]
    first = "none seen" if r.get("first_hop_s") is None else f"{r['first_hop_s']:.2f} s"
    print(f"  first hop after Start: {first} (goal <= {goal} s; {caches}; engine process {ready})")
    print(f"  the musicnn push: {r.get('push') or '-'}; the models' steady steps: {r.get('kernels') or '-'}")


def print_soak(r: dict) -> None:
    print_gui(r)
    print(f"  worst delay p95 over 10 s (after the first 30 s): {r['delay_ms_worst_p95']:.0f} ms")
    for who, key in (("window", "rss_mb"), ("engine", "engine_rss_mb")):
        (_, start), (_, end) = r[key][0], r[key][-1]
        peak = max(mb for _, mb in r[key])
        growth = r[key.replace("mb", "growth_after_5min_mb")]
        print(f"  {who} process resident memory: {start:.0f} MB at the start, {end:.0f} MB at the end, "
              f"peak {peak:.0f} MB; " + (f"growth after the first 5 minutes {growth:+.1f} MB (goal < 20 MB)"
                                         if growth is not None else
                                         "growth after the first 5 minutes: run 10 minutes or more to see it"))
    print("  minute  window RSS (MB)  engine RSS (MB)")
    shown = -1
    for i, ((t, mb), (_, emb)) in enumerate(zip(r["rss_mb"], r["engine_rss_mb"])):
        if t // 300 > shown or i == len(r["rss_mb"]) - 1:      # one sample per 5 minutes, and the last
            shown = t // 300
            print(f"  {t / 60:6.1f}  {mb:15.1f}  {emb:15.1f}")


def soak_progress(seconds: float, rss: float, dropped: int) -> None:
    if seconds % 300 < 10:                                   # a line every 5 minutes
        print(f"  {seconds / 60:5.1f} min: {rss:.0f} MB resident, {dropped} hops dropped", flush=True)


@command("bench", add_arguments)
def run(args) -> int:
    def page(kind: str, data) -> None:
        if args.page:
            from app.bench.page import record
            record(kind, data)
    if args.streams:                           # what the run cannot do: said before any work
        compute_device(args, "bench")
        if args.models:
            from app.runtime.lineup import UnknownModelError, choose_shipped, load_trained, shipped_checkpoints
            try:
                choose_shipped([load_trained(p, "musicnn", "cpu") for p in shipped_checkpoints("musicnn")],
                               args.models)
            except UnknownModelError as e:
                return error(f"--models: {e}")
    if not (args.gui and args.cold):           # no compiled form builds beside a timed part
        from .prepare import prepare_all
        prepare_all(["float32"] + (["bf16"] if args.precision == "bf16" else []))
    if args.evaluate:
        from app.offline.evaluate_speed import evaluate_speed
        r = evaluate_speed()
        print(f"evaluate: {r['sequences']} sequences x {r['steps']} steps x {r['models']} models "
              f"streamed, with batch-forward agreement and cost streams, in {r['seconds']:.1f} s "
              f"({r['threads']} threads; goal < 120 s)")
        page("evaluate", r)
    fe = "vggish" if args.frontend == "vggish" else "musicnn"
    if args.gui:
        from app.gui.bench import gui
        r = gui(args.gui, args.vggish_weights, fe, hogs=args.hogs, cold=args.cold)
        print_gui(r)
        page((f"gui-hogs{args.hogs}" if args.hogs else "gui-quiet") + ("-cold" if args.cold else ""), r)
    if args.soak:
        from app.gui.bench import gui
        r = gui(args.soak, args.vggish_weights, fe, progress=soak_progress, hogs=args.hogs)
        print_soak(r)
        page("soak", r)
    if args.control:
        from app.bench.control import control_storm, print_control
        r = control_storm(args.control, fe)
        print_control(r)
        page("control", r)
    if args.scale:
        from app.bench.scale import print_scale, scale
        r = scale(args.scale, fe)
        print_scale(r)
        page("scale", r)
    if args.onnx:
        from app.bench.onnx import onnx_bench, print_onnx
        r = onnx_bench(args.steps, args.budget, only=args.only)
        print_onnx(r)
        page("onnx", r)
    if args.streams:
        import torch

        from app.bench.frontend_modes import frontend_modes_bench
        from app.bench.streams import print_streams, step_bench, streams_bench, streams_key, tensor_bench
        from app.runtime.lineup import UnknownModelError
        if args.threads:
            torch.set_num_threads(args.threads)
        try:                                               # a model that is not shipped: said before any row
            cap = dict(max_streams=args.streams_to) if args.streams_to else {}
            r = streams_bench(args.device, models=args.models, mode=args.precision, start=args.streams_from, **cap)
        except UnknownModelError as e:
            return error(f"--models: {e}")
        r["tensor"] = tensor_bench(args.device, models=args.models, mode=args.precision, start=args.streams_from, **cap)
        if args.precision != "float32":
            from app.bench.precision import precision_error
            r["precision_error"] = precision_error(args.device, args.precision, models=args.models)
        if cap:
            r["capped_at"] = r["tensor"]["capped_at"] = args.streams_to
        else:
            r["frontend_modes"] = frontend_modes_bench(args.device, mode=args.precision)
        r["steps"] = step_bench(args.device, models=args.models)
        print_streams(r)
        page(streams_key(args.device, args.models, args.precision) + (f"-to{args.streams_to}" if cap else ""), r)
    if args.engines:
        from app.bench.engines import engines_bench, print_engines
        r = engines_bench(threads=args.threads, only=args.only)
        print_engines(r)
        page("engines", r)
    if args.serve:
        from app.bench.serve import print_serve, serve_bench
        r = serve_bench(args.serve, args.serve_seconds, ray=args.replicas, batch_delay_ms=args.batch_delay_ms,
                        workers=args.serve_processes)
        print_serve(r)
        page(f"serve-{args.serve}" + (f"-workers{args.serve_processes}" if args.serve_processes > 1 else "")
             + (f"-ray{args.replicas}" if args.replicas else "")
             + (f"-delay{args.batch_delay_ms:g}" if args.batch_delay_ms is not None else ""), r)
    if (args.evaluate or args.gui or args.soak or args.control or args.scale or args.onnx or args.streams
            or args.serve or args.engines):
        return 0
    from app.bench import steps as bench
    data = bench.run(args.windows, steps=args.steps, budget_s=args.budget,
                     out=args.out, threads=args.threads,
                     frontends=("musicnn", "vggish") if args.frontend == "all" else (args.frontend,),
                     frontend_only=args.frontend_only, only=args.only)
    page("attention", data)
    return 0
