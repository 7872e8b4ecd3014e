"""The comparison table (one row per model over the last minute) and the status bar texts."""
from __future__ import annotations

import statistics

from PySide6.QtWidgets import QHeaderView, QTableWidget, QTableWidgetItem

from app.runtime.records import percentile, reference_for
from audio.melspec import HOP_MS

COLUMNS = ["model", "landmarks", "top genre", "agrees with (reference)",
           "SDA FLOPs/step, mean (min-max)", "model FLOPs/step, mean (min-max)",
           "latency median / p95 (ms)", "state memory", "weights"]


def same_mode_run(recent: list, name: str) -> list:
    """``name``'s ModelSteps at the end of ``recent`` since it last changed landmark mode (or
    joined), past warm-up once it has any full-window step (as the evaluate report counts): the
    steps whose costs describe what it does now."""
    mode, run = recent[-1].models[name].landmark_mode, []
    for r in reversed(recent):
        m = r.models.get(name)
        if m is None or m.landmark_mode != mode:
            break
        run.append(m)
    full = [m for m in run if m.warm]
    return (full or run)[::-1]


def weights_text(trained: bool, frontend: str) -> str:
    """What a model's prediction is worth: untrained, or trained but fed a RANDOM front end's
    tokens (a checkpoint trained on real VGGish embeddings run without the VGGish weights)."""
    if not trained:
        return "UNTRAINED (random)"
    return "trained, on RANDOM tokens: not meaningful" if "RANDOM" in frontend else "trained"


def label_text(genre: str, p: float, trained: bool, frontend: str) -> str:
    """The big label: a genre and its probability, and what the model's weights are worth."""
    warn = ("  (untrained)" if not trained else
            "  (RANDOM front end: not meaningful)" if "RANDOM" in frontend else "")
    return f"{genre}  {100 * p:.0f}%{warn}"


def preferred_focus(models: dict, current: str) -> str | None:
    """The model the big label follows: ``current`` while it runs, else the product's model
    (continual Nyström), trained ones first; None leaves the choice as it is."""
    if current in models:
        return current
    nystrom = [n for n, m in models.items() if m.variant == "continual_nystrom"]
    return next((n for n in nystrom if models[n].trained), nystrom[0] if nystrom else None)


def flops_cell(steps: list, key: str) -> str:
    """Mean FLOPs per step over ``steps`` (over a minute of steady running: the landmark-cycle
    mean of the evaluate report, up to a partial cycle), with the min-max where they vary:
    '11,637 (9,280-25,664)'."""
    values = [m.flops[key] for m in steps]
    lo, hi, mean = min(values), max(values), round(statistics.fmean(values))
    return f"{mean:,}" if lo == hi else f"{mean:,} ({lo:,}-{hi:,})"


def agreement(recent: list, name: str) -> str:
    """How often ``name``'s top class equals its reference model's over ``recent``, e.g.
    '97% (regular)'; '—' when no `regular` model runs beside it."""
    ref = reference_for(name, recent[-1].models)
    if ref is None:
        return "—"
    steps = [r for r in recent if name in r.models and ref in r.models]
    same = sum(r.models[name].top[0] == r.models[ref].top[0] for r in steps)
    return f"{100 * same / len(steps):.0f}% ({ref})" if steps else "—"


class ComparisonTable(QTableWidget):
    def __init__(self):
        super().__init__(0, len(COLUMNS))
        self.setHorizontalHeaderLabels(COLUMNS)
        self.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.verticalHeader().hide()

    def show_steps(self, recent: list) -> None:
        """One row per model of the newest StepResult, over ``recent`` (the last minute)."""
        last = recent[-1]
        models = list(last.models)
        self.setRowCount(len(models) + 1)
        front = [r.stages["frontend"] for r in recent]
        self._set_row(len(models), [f"front end: {last.frontend}", "—", "—", "—", "—",
                                    f"{last.frontend_flops:,} (per hop)",
                                    f"{statistics.median(front):.2f} / {percentile(front, 0.95):.2f}",
                                    "—", "pretrained" if "RANDOM" not in last.frontend else "RANDOM"])
        for row, name in enumerate(models):
            m = last.models[name]
            lat = [r.models[name].latency_ms for r in recent if name in r.models]
            genre, p = m.top
            run = same_mode_run(recent, name)
            self._set_row(row, [name, m.landmark_mode or "—", f"{genre} {100 * p:.0f}%",
                                agreement(recent, name) if m.variant != "regular" else "—",
                                flops_cell(run, "sda"), flops_cell(run, "model"),
                                f"{statistics.median(lat):.2f} / {percentile(lat, 0.95):.2f}",
                                f"{m.state_bytes / 1024:.1f} KiB", weights_text(m.trained, last.frontend)])

    def _set_row(self, row: int, cells: list[str]) -> None:
        for c, text in enumerate(cells):
            item = self.item(row, c)
            if item is None:
                item = QTableWidgetItem()
                self.setItem(row, c, item)
            item.setText(text)


def status_texts(recent: list, paused: bool, device: str, delay_ms) -> dict[str, str]:
    """The status bar's fields from ``recent`` (the last minute of StepResults)."""
    last = recent[-1]
    rtf = statistics.fmean(r.stages["frontend"] + sum(m.latency_ms for m in r.models.values())
                           for r in recent) / HOP_MS
    front = [r.stages["frontend"] for r in recent]
    rate = f", {last.input_rate} Hz in" if last.input_rate else ""
    out = {"frontend": f"Front end: {statistics.median(front):.1f} / {percentile(front, 0.95):.1f} ms "
                       f"median / p95, {last.frontend_flops / 1e6:.0f}M FLOPs/hop",
           "source": f"Source: {last.source}{rate}{'  (paused)' if paused else ''}",
           "rtf": f"Real-time factor: {rtf:.2f}",
           "dropped": f"Dropped hops: {last.dropped_hops}",
           "weights": f"Tokens: {last.frontend}",
           "device": f"Compute: {device}"}
    if delay_ms:
        out["delay"] = f"Delay p95: {percentile(delay_ms, 0.95):.0f} ms"
    return out
