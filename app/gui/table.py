"""The comparison table (one row per model over the last minute) and the status bar texts."""
from __future__ import annotations

import statistics

from PySide6.QtWidgets import QHeaderView, QTableWidget, QTableWidgetItem

from app.runtime.records import percentile, reference_for
from audio.melspec import HOP_MS

COLUMNS = ["model", "landmarks", "top genre", "agrees with (reference)", "SDA FLOPs/step",
           "model FLOPs/step", "latency median / p95 (ms)", "state memory", "weights"]


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
            self._set_row(row, [name, m.landmark_mode or "—", f"{genre} {100 * p:.0f}%",
                                agreement(recent, name) if m.variant != "regular" else "—",
                                f"{m.flops['sda']:,}", f"{m.flops['model']:,}",
                                f"{statistics.median(lat):.2f} / {percentile(lat, 0.95):.2f}",
                                f"{m.state_bytes / 1024:.1f} KiB",
                                "trained" if m.trained else "UNTRAINED (random)"])

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
