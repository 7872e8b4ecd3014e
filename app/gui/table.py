"""The comparison table (one row per model over the last minute) and the status bar texts."""
from __future__ import annotations

import statistics

from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QHeaderView, QLabel, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

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


AUTO = "auto: a regular model of the same shape"


def reference_of(name: str, models: dict, choice: str | None) -> str | None:
    """``name``'s reference for agreement: the chosen model when it runs with ``name``'s shape
    (blocks, window, classes), else a `regular` model (records.reference_for)."""
    me, ref = models[name], models.get(choice)
    if ref is not None and choice != name and (ref.layers, ref.window, ref.classes) == (me.layers, me.window, me.classes):
        return choice
    return reference_for(name, models)


def agreement(recent: list, name: str, choice: str | None = None) -> str:
    """How often ``name``'s top class equals its reference model's over ``recent``, e.g.
    '97% (regular)'; 'reference' for the chosen reference itself; '—' without a reference."""
    models = recent[-1].models
    if name == choice:
        return "reference"
    if choice not in models and models[name].variant == "regular":
        return "—"                       # the automatic reference is exact attention itself
    ref = reference_of(name, models, choice)
    if ref is None:
        return "—"
    steps = [r for r in recent if name in r.models and ref in r.models]
    same = sum(r.models[name].top[0] == r.models[ref].top[0] for r in steps)
    return f"{100 * same / len(steps):.0f}% ({ref})" if steps else "—"


class ComparisonTable(QWidget):
    """One row per model over the last minute, and the choice of the agreement reference."""

    def __init__(self):
        super().__init__()
        col = QVBoxLayout(self)
        col.setContentsMargins(2, 2, 2, 2)
        row = QHBoxLayout()
        row.addWidget(QLabel("Agreement reference"))
        self.reference_box = QComboBox()
        self.reference_box.setToolTip("the model each row's top genre is compared with; a model of "
                                      "another shape (blocks, window) is compared with a regular model "
                                      "of its own shape")
        self.reference_box.addItem(AUTO, "")
        row.addWidget(self.reference_box)
        row.addStretch(1)
        col.addLayout(row)
        self.grid = QTableWidget(0, len(COLUMNS))
        self.grid.setHorizontalHeaderLabels(COLUMNS)
        self.grid.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.grid.verticalHeader().hide()
        col.addWidget(self.grid, 1)
        self.wanted = ""                  # a saved choice, taken when that model runs

    def save(self, settings) -> None:
        settings.setValue("table/reference", self.reference or self.wanted)

    def restore(self, settings) -> None:
        self.wanted = str(settings.value("table/reference", "") or "")

    @property
    def reference(self) -> str | None:
        return self.reference_box.currentData() or None

    def _offer(self, models: list[str]) -> None:
        """The reference choices: automatic, or any running model (the choice kept while it runs)."""
        offered = [self.reference_box.itemData(i) for i in range(1, self.reference_box.count())]
        if offered == models:
            return
        chosen = self.reference or self.wanted
        self.reference_box.blockSignals(True)
        while self.reference_box.count() > 1:
            self.reference_box.removeItem(1)
        for name in models:
            self.reference_box.addItem(name, name)
        self.reference_box.setCurrentIndex(max(self.reference_box.findData(chosen), 0) if chosen else 0)
        if self.reference:
            self.wanted = ""
        self.reference_box.blockSignals(False)

    def show_steps(self, recent: list) -> None:
        """One row per model of the newest StepResult, over ``recent`` (the last minute)."""
        last = recent[-1]
        models = list(last.models)
        self._offer(models)
        self.grid.setRowCount(len(models) + 1)
        front = [r.stages["frontend"] for r in recent]
        self._set_row(len(models), ["front end", "—", "—", "—", "—",
                                    f"{last.frontend_flops:,} (per hop)",
                                    f"{statistics.median(front):.2f} / {percentile(front, 0.95):.2f}",
                                    "—", last.frontend])
        for row, name in enumerate(models):
            m = last.models[name]
            lat = [r.models[name].latency_ms for r in recent if name in r.models]
            genre, p = m.top
            run = same_mode_run(recent, name)
            self._set_row(row, [name, m.landmark_mode or "—", f"{genre} {100 * p:.0f}%",
                                agreement(recent, name, self.reference),
                                flops_cell(run, "sda"), flops_cell(run, "model"),
                                f"{statistics.median(lat):.2f} / {percentile(lat, 0.95):.2f}",
                                f"{m.state_bytes / 1024:.1f} KiB", weights_text(m.trained, last.frontend)])

    def _set_row(self, row: int, cells: list[str]) -> None:
        for c, text in enumerate(cells):
            item = self.grid.item(row, c)
            if item is None:
                item = QTableWidgetItem()
                self.grid.setItem(row, c, item)
            item.setText(text)


def status_texts(recent: list, paused: bool, device: str, delay_ms) -> dict[str, str]:
    """The status bar's three fields from ``recent`` (the last minute of StepResults): the source,
    how the run keeps up (real-time factor, dropped hops, delay), and the tokens and compute.
    Short, so that a message on the left of the bar keeps its room."""
    last = recent[-1]
    rtf = statistics.fmean(r.stages["frontend"] + sum(m.latency_ms for m in r.models.values())
                           for r in recent) / HOP_MS
    rate = f", {last.input_rate} Hz" if last.input_rate else ""
    delay = f" · delay p95 {percentile(delay_ms, 0.95):.0f} ms" if delay_ms else ""
    return {"source": f"{'PAUSED · ' if paused else ''}{last.source}{rate}",
            "run": f"real-time factor {rtf:.2f} · dropped hops: {last.dropped_hops}{delay}",
            "tokens": f"tokens: {last.frontend} · {device}"}
