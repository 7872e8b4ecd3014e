"""Result tables of the docs, generated from the stored runs they state: a page holds a table
between ``<!-- table NAME -->`` and ``<!-- /table -->`` lines, and ``write()`` rewrites it from
its data (`python -m app.bench.doc_tables`; `tests/app/test_doc_tables.py` fails when a page
and its data disagree). Figures are never copied by hand."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from models.paper import PAPER_ACCURACY, PAPER_TABLE_II, TABLE_ROWS

from app.bench.page import provenance, stored
from audio.melspec import HOP_SECONDS

from app.offline.report import _si

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs/benchmarks"          # the stored `bench --page` runs
ROW_NAMES = {"continual_nystrom/continual": "continual_nystrom, continual landmarks",
             "continual_nystrom/fixed": "continual_nystrom, fixed landmarks"}


def _rows(report: dict) -> dict[tuple[str, int], dict]:
    return {(m["summary"]["key"], m["config"]["layers"]): m["summary"] for m in report["models"]}


def _accuracy(s: dict | None) -> str:
    return "–" if s is None else f"{100 * s['accuracy_mean']:.1f} ± {100 * s['accuracy_std']:.1f}"


def musicnn_accuracy(report: dict) -> str:
    """Test accuracy per variant, 1 and 2 blocks, beside the paper's (docs/musicnn/report.json)."""
    rows = _rows(report)
    lines = ["| row | paper (VGGish, n = 120) | 1 block | 2 blocks |", "| --- | --- | --- | --- |"]
    for key in TABLE_ROWS:
        lines.append(f"| {ROW_NAMES.get(key, key)} | {PAPER_ACCURACY[key]} | {_accuracy(rows.get((key, 1)))} "
                     f"| {_accuracy(rows.get((key, 2)))} |")
    return "\n".join(lines)


def musicnn_accuracy_and_flops(report: dict) -> str:
    """The same with the SDA FLOPs per step measured (1 / 2 blocks) and the paper's."""
    rows = _rows(report)
    lines = ["| row | paper (VGGish, n = 120) | here, 1 block | here, 2 blocks | SDA FLOPs/step here (1 / 2 blocks) "
             "| paper SDA FLOPs |", "| --- | --- | --- | --- | --- | --- |"]
    for key in TABLE_ROWS:
        one, two = rows.get((key, 1)), rows.get((key, 2))
        flops = " / ".join(_si(s["sda_flops_mean"]) if s else "–" for s in (one, two))
        lines.append(f"| {ROW_NAMES.get(key, key)} | {PAPER_ACCURACY[key]} | {_accuracy(one)} | {_accuracy(two)} "
                     f"| {flops} | {_si(PAPER_TABLE_II[key])} |")
    return "\n".join(lines)


def readme_results(data: dict) -> str:
    """The README's table: each shipped model's recorded test accuracy (its checkpoint's, which
    a test recomputes), the paper-setting SDA FLOPs (models/flops.py) and the stored `bench
    --windows 120` run's speed-up of the 1-block step over torch's encoder layer."""
    lines = ["| variant (1 block) | test accuracy, shipped model | SDA FLOPs per step (paper's setting) "
             "| model step vs torch's encoder layer |", "| --- | ---: | ---: | ---: |"]
    for key in TABLE_ROWS:
        variant, _, mode = key.partition("/")
        name = f"`{variant}`" + (f", {mode} landmarks" if mode else "")
        speed = data["speedup"].get(key)
        lines.append(f"| {name} | {100 * data['accuracy'][key]:.1f} % | {data['flops'][key]:,.0f} "
                     f"| {'–' if speed is None else f'{speed:.1f}x'} |")
    return "\n".join(lines)


def _readme_data() -> dict:
    from app.runtime.lineup import shipped_checkpoints
    from app.checkpoint import load_checkpoint
    from models.flops import paper_table_ii
    accuracy = {}
    for path in shipped_checkpoints("musicnn"):
        model, payload = load_checkpoint(path)
        key = model.cfg.variant + (f"/{model.cfg.home_landmark_mode}" if model.cfg.variant == "continual_nystrom" else "")
        accuracy[key] = payload["metadata"]["metrics"]["test_acc"]
    run = _attention_run()
    speedup = {}
    for key in TABLE_ROWS:
        rows = {r["what"]: r for r in run["data"]["rows"] if r["n"] == 120}
        row = rows.get(f"model 1-block {key} (fused)") or rows.get(f"model 1-block {key}")
        if row is not None:
            speedup[key] = row["extra"]["vs_recompute"]
    return {"accuracy": accuracy, "flops": paper_table_ii(), "speedup": speedup}


FRONTEND_ROWS = (("front end: musicnn log-mel per hop", "log-mel (the hop's new frames)"),
                 ("front end: musicnn network per hop, continual, the push as one graph compiled",
                  "network, continual: the push as one graph, compiled (the app's)"),
                 ("front end: musicnn network per hop, continual, the push as one graph, eager",
                  "network, continual: the same graph, eager"),
                 ("front end: musicnn network per hop, continual, the batched form with one slot",
                  "network, continual: the batched form with one slot (what one CUDA stream runs)"),
                 ("front end: musicnn network per hop, recomputing", "network, recomputing the 3 s patch"))


def frontend_speed(run: dict) -> str:
    """One stream's musicnn hop, continual against recomputed, from the stored `bench --windows`
    run (docs/benchmarks/attention.json): the two networks alternate hop by hop."""
    rows = run["data"]["frontend"]
    picked = {label: next(r for r in rows if r["what"].startswith(what)) for what, label in FRONTEND_ROWS}
    lines = ["| per hop, batch 1 | median ms | p95 ms | MFLOPs |", "| --- | ---: | ---: | ---: |"]
    for label, r in picked.items():
        flops = "–" if r["flops"] is None else f"{r['flops'] / 1e6:,.0f}"
        lines.append(f"| {label} | {r['median_us'] / 1e3:.2f} | {r['p95_us'] / 1e3:.2f} | {flops} |")
    mel, cont, _, batch, full = (picked[label] for _, label in FRONTEND_ROWS)
    hop = mel["median_us"]
    lines += ["", f"The app's continual network against the batched form with one slot: "
              f"{batch['median_us'] / cont['median_us']:.2f}x faster (the hop with its log-mel: "
              f"{(batch['median_us'] + hop) / (cont['median_us'] + hop):.2f}x); against recomputing: "
              f"{full['median_us'] / cont['median_us']:.2f}x faster, {full['flops'] / cont['flops']:.2f}x fewer FLOPs; "
              f"real-time factor {cont['median_us'] / 1e6 / HOP_SECONDS:.3f} (its median over the {HOP_SECONDS:g} s hop).",
              "", provenance(run)]
    return "\n".join(lines)


def frontend_modes(runs: dict) -> str:
    """The batched musicnn push by which temporal branches keep accumulators, from the stored
    `bench --streams` runs that measured it (CPU, and CUDA in TF32); the default is the code's."""
    from audio.musicnn import PRECISION_WORDS
    from audio.musicnn.batch import default_accumulate
    lines = ["| device | streams | branches accumulating | push, median ms | MFLOPs per stream-hop "
             "| state MB per stream | the default |", "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
    notes = []
    for run in runs.values():
        data = run["data"]
        device = ("CPU" if data["device"] == "cpu" else run["machine"].get("gpu", "CUDA")) \
            + ("" if data["precision"] == "float32" else f", {PRECISION_WORDS[data['precision']]}")
        default = default_accumulate(data["device"], data["precision"])
        for r in data["frontend_modes"]:
            lines.append(f"| {device} | {r['streams']:,} | {r['mode']} | {r['push_ms_median']:.1f} "
                         f"| {r['mflops_per_stream_hop']:.0f} | {r['state_mb_per_stream']:.1f} "
                         f"| {'yes' if tuple(r['accumulate']) == default else ''} |")
        notes.append(f"- {device}: {provenance(run)}")
    return "\n".join(lines + [""] + notes)


def table_ii(_: None) -> str:
    """Table II of the Continual Nyström paper beside our formulas in its setting, in its
    convention and as the app computes (models/flops.py)."""
    from models.flops import as_implemented_table_ii, paper_table_ii
    ours, real = paper_table_ii(), as_implemented_table_ii()
    why = {"nystrom": "recomputes all n outputs", "continual_nystrom/continual": "average over a cycle",
           "continual_nystrom/fixed": f"{real['continual_nystrom/fixed']:,.0f} = "
           f"{real['continual_nystrom/fixed'] / ours['continual_nystrom/fixed']:.2f}x; cheaper than continual, as in the paper"}

    def mega(x: float) -> str:
        return f"{x / 1e6:.3g}M"
    lines = ["| SDA variant | paper | ours, paper convention | ours, as implemented |", "| --- | ---: | ---: | ---: |"]
    for key in TABLE_ROWS:
        note = f" ({why[key]})" if key in why else ""
        lines.append(f"| {ROW_NAMES.get(key, key)} | {PAPER_TABLE_II[key] / 1e6:g}M | {mega(ours[key])} "
                     f"| {mega(real[key])}{note} |")
    return "\n".join(lines)


def _attention_run() -> dict:
    return stored(RUNS)["attention"]


def _frontend_mode_runs() -> dict:
    return {kind: run for kind, run in stored(RUNS).items()
            if kind.startswith("streams-") and run["data"].get("frontend_modes")}


def _musicnn_report() -> dict:
    return json.loads((ROOT / "docs/musicnn/report.json").read_text())


# name -> (the pages holding it, its data, how it is drawn)
TABLES = {
    "musicnn-accuracy": (("docs/results.md",), _musicnn_report, musicnn_accuracy),
    "musicnn-accuracy-flops": (("docs/musicnn/README.md",), _musicnn_report, musicnn_accuracy_and_flops),
    "readme-results": (("README.md",), _readme_data, readme_results),
    "table-ii": (("docs/guarantees.md",), lambda: None, table_ii),
    "frontend-speed": (("docs/front-ends.md",), _attention_run, frontend_speed),
    "frontend-modes": (("docs/front-ends.md",), _frontend_mode_runs, frontend_modes),
}
BLOCK = re.compile(r"(<!-- table (?P<name>[\w-]+) -->\n)(?P<body>.*?)(\n<!-- /table -->)", re.S)


def blocks(text: str) -> dict[str, str]:
    """The generated tables of a page: name -> its text."""
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def rendered(page: str) -> str:
    """``page``'s text with each of its tables drawn from its data now."""
    text = (ROOT / page).read_text()

    def draw(m: re.Match) -> str:
        _, data, draw_table = TABLES[m["name"]]
        return m.group(1) + draw_table(data()) + m.group(4)
    return BLOCK.sub(draw, text)


def pages() -> list[str]:
    return sorted({p for pages_, _, _ in TABLES.values() for p in pages_})


BENCHMARKS = "docs/benchmarks.md"          # a page drawn whole from its runs (app/bench/page.py)


def benchmarks_page() -> str:
    """docs/benchmarks.md as its stored runs and design measurements draw it now."""
    from app.bench.page import render
    return render(RUNS)


def write() -> list[str]:
    """Rewrite every page whose tables differ from their data; the pages rewritten."""
    changed = []
    for page in [*pages(), BENCHMARKS]:
        text = benchmarks_page() if page == BENCHMARKS else rendered(page)
        if text != (ROOT / page).read_text():
            (ROOT / page).write_text(text)
            changed.append(page)
    return changed


if __name__ == "__main__":
    print("\n".join(f"rewrote {p}" for p in write()) or "every generated table matches its data", file=sys.stderr)
