"""The evaluation report: report.md, report.json and PNG plots (matplotlib, Agg backend).

Plots: accuracy as a function of stream time, SDA FLOPs per step over the cost stream (log scale,
landmark-update steps visible as spikes), confusion matrices, per-class accuracy.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from audio.files import atomic_write_json, atomic_write_text
from audio.frontends import frontend_of_tokens
from models.flops import paper_table_ii
from models.paper import PAPER_ACCURACY, PAPER_TABLE_II, TABLE_ROWS


def percent(a) -> str:
    """A recall as a whole percentage; a class without test sequences has none (—, not 0 %)."""
    return "—" if a is None or not np.isfinite(a) else f"{100 * a:.0f}"


def _si(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.3g}M"
    if x >= 1e3:
        return f"{x / 1e3:.3g}k"
    return f"{x:.0f}"


def _hop(report: dict) -> tuple[float | None, str]:
    """Seconds per token and the x label: token files that `extract` wrote record their spacing
    (``frontend_info.spacing_s``; older VGGish ones their hop in samples); the converted musicnn
    taggrams do not, and their plots count tokens."""
    metadata = report["tokens"]["metadata"]
    spacing = (metadata.get("frontend_info") or {}).get("spacing_s")
    if spacing:
        return spacing, "stream time (s)"
    frontend = metadata.get("frontend") or {}
    if "hop" in frontend:
        return frontend["hop"] / frontend["sample_rate"], "stream time (s)"
    return None, "tokens streamed"


def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    genres = report["tokens"]["genres"]
    hop, xlabel = _hop(report)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m in models:
        curves = np.array([c["accuracy_by_step"] for c in m["checkpoints"]], dtype=float)
        mean = curves.mean(0)
        x = (np.arange(len(mean)) + 1) * (hop or 1)
        ax.plot(x, 100 * mean, label=m["summary"]["name"])
    ax.set(xlabel=xlabel, ylabel="test accuracy (%)", title="Accuracy as the stream goes on\n(mean over seeds; up to the shortest test sequence)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "accuracy_vs_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m in models:
        sda = m["costs"]["sda_flops"]
        ax.plot(np.arange(1, len(sda) + 1), sda, label=m["summary"]["name"], lw=1)
    ax.set_yscale("log")
    ax.axvline(models[0]["config"]["window"], color="grey", ls=":", lw=1)
    ax.set(xlabel="step (batch 1; dotted: window full)", ylabel="SDA FLOPs per step",
           title="SDA FLOPs per step (spikes: landmark updates, refreshes)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "flops_per_step.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    cols = min(len(models), 4)
    rows = (len(models) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.7 * rows), squeeze=False,
                             constrained_layout=True)         # the suptitle keeps its room
    for ax in axes.flat:
        ax.axis("off")
    for ax, m in zip(axes.flat, models):
        conf = np.sum([c["confusion"] for c in m["checkpoints"]], axis=0)
        ax.axis("on")
        ax.imshow(conf, cmap="Blues")
        ax.set_title(m["summary"]["name"], fontsize=7)
        ax.set_xticks(range(len(genres)), genres, rotation=90, fontsize=6)       # names in full
        ax.set_yticks(range(len(genres)), genres, fontsize=6)
        for i in range(len(genres)):
            for j in range(len(genres)):
                if conf[i, j]:
                    ax.text(j, i, int(conf[i, j]), ha="center", va="center", fontsize=5,
                            color="white" if conf[i, j] > conf.max() / 2 else "black")
    fig.suptitle("Confusion matrices (rows: true genre; summed over seeds)", fontsize=9)
    paths.append(out / "confusion.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        ax.bar(np.arange(len(genres)) + i * width, 100 * np.array(m["summary"]["per_class"]),
               width, label=m["summary"]["name"])
    ax.set_xticks(np.arange(len(genres)) + 0.4 - width / 2, genres, rotation=30, fontsize=8)
    ax.set(ylabel="accuracy (%)", title="Per-class accuracy (mean over seeds)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(out / "per_class.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def markdown(report: dict, title: str, commands: str | None, images: list[Path]) -> str:
    tok = report["tokens"]
    models = report["models"]
    L = [f"# {title}", "",
         f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `python main.py evaluate` "
         f"(torch {report['torch']}, {report['threads']} CPU threads, {report['seconds']:.1f} s).", "",
         f"Tokens: `{Path(tok['file']).name}` (sha256 `{tok['sha256'][:16]}…`), X {tuple(tok['shape'])} "
         f"(sequences, tokens, dimension). Source: {tok['metadata'].get('source', 'unknown')}."
         + (f" Classes: {', '.join(tok['genres'])}. Split: {tok['split']}." if tok.get("split") else ""), ""]
    if frontend_of_tokens(tok["metadata"], tok["shape"][-1]).get("random"):
        L += ["**RANDOM front end: these tokens were made by a VGGish with random weights "
              f"({tok['metadata'].get('vggish_description') or tok['metadata'].get('vggish')}). "
              "The accuracies below say nothing about genre recognition; the FLOPs, latencies "
              "and stream/batch agreement still hold.**", ""]
    if commands:
        L += ["Commands that produced this report:", "", "```sh", commands.strip(), "```", ""]
    L += ["## Results", "",
          "Accuracy: last step of each test sequence, streamed token by token (mean ± std over seeds). "
          "Agreement: streaming vs batch forward argmax (lowest over seeds). FLOPs: per step for one stream "
          "once the window is full (mean; min–max), counted by the formulas the tests check. "
          "Latency: batch 1, median / p95. Relative FLOPs: against a `regular` model of the same shape.", "",
          "| model | seeds | accuracy % | agreement | max logit diff | SDA FLOPs/step | rel. SDA | "
          "model FLOPs/step | rel. model | latency ms (median / p95) | state memory |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in models:
        s = m["summary"]
        upd = f", {s['update_steps']} update steps of {s['steady_steps']}" if s["update_steps"] else ""
        L.append(f"| {s['name']} | {len(s['seeds'])} | {100 * s['accuracy_mean']:.1f} ± {100 * s['accuracy_std']:.1f} "
                 f"| {100 * s['agreement_min']:.1f}% | {s['max_logit_diff']:.1e} "
                 f"| {_si(s['sda_flops_mean'])} ({_si(s['sda_flops_min'])}–{_si(s['sda_flops_max'])}{upd}) "
                 f"| {s['relative_sda_flops']:.3f} | {_si(s['model_flops_mean'])} | {s['relative_model_flops']:.3f} "
                 f"| {s['latency_ms_median']:.3f} / {s['latency_ms_p95']:.3f} | {s['state_bytes'] / 1024:.1f} KiB |")
    formula = paper_table_ii()
    L += ["", "## Table II layout (Carreto Picón et al.)", "",
          "Paper: GTZAN, VGGish tokens, n = 120, m = 4, d = 192, random 72/18/10 splits. "
          "\"Formula, paper setting\" is our FLOP formula in the paper's setting and counting convention "
          "(`models/flops.py: paper_table_ii`); \"measured here\" is what the app counts for the evaluated models "
          "(their n, all heads, stability bookkeeping included).", ""]
    layers = sorted({m["config"]["layers"] for m in models})
    head = "| row | SDA FLOPs paper | formula, paper setting | " + " | ".join(
        f"measured here, {n} block{'s' if n > 1 else ''}" for n in layers) + " | accuracy paper % | " + " | ".join(
        f"accuracy here, {n} block{'s' if n > 1 else ''} %" for n in layers) + " |"
    L += [head, "|" + " --- |" * (4 + 2 * len(layers))]
    for key in TABLE_ROWS:
        found = {n: next((m["summary"] for m in models if m["summary"]["key"] == key
                          and m["config"]["layers"] == n), None) for n in layers}
        flops = " | ".join(_si(f["sda_flops_mean"]) if f else "–" for f in found.values())
        acc = " | ".join(f"{100 * f['accuracy_mean']:.1f} ± {100 * f['accuracy_std']:.1f}" if f else "–"
                         for f in found.values())
        L.append(f"| {key} | {_si(PAPER_TABLE_II[key])} | {_si(formula[key])} | {flops} | "
                 f"{PAPER_ACCURACY[key]} | {acc} |")
    genres = tok["genres"]
    L += ["", "## Per-class accuracy (%)", "", "| model | " + " | ".join(genres) + " |",
          "|" + " --- |" * (len(genres) + 1)]
    for m in models:
        L.append(f"| {m['summary']['name']} | " + " | ".join(percent(a) for a in m["summary"]["per_class"]) + " |")
    if any(percent(a) == "—" for m in models for a in m["summary"]["per_class"]):
        L += ["", "—: the test set holds no sequence of this genre (no accuracy, not 0 %)."]
    L += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in images] + [""]
    return "\n".join(L)


def write_report(report: dict, folder: str | Path, *, title: str = "Nystream evaluation",
                 commands: str | None = None) -> list[Path]:
    """Write report.json, the PNG plots and report.md into ``folder``; returns the paths."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    images = plot(report, out)
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", markdown(report, title, commands, images))
    return [out / "report.md", out / "report.json", *images]
