"""What the window exports: step records (CSV), the plots (PNG with a caption), and beside either
a session summary (JSON) saying where the numbers came from. Qt only for the image. Every file
is written whole or not at all (audio/files.py: a full disk leaves no part of a CSV or a PNG)."""
from __future__ import annotations

import csv
import io
import statistics
import time
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
from PySide6.QtGui import QColor, QFont, QImage, QPainter

from app.runtime.faults import asked_for, resource_message
from app.runtime.csv_rows import safe_cell
from app.runtime.records import csv_row
from app.runtime.verdict import Tally
from audio.files import atomic_write, atomic_write_json

from .table import weights_text


def with_suffix(path: str, suffix: str) -> Path:
    """``path`` with ``suffix`` added when it has no suffix of that kind (a save dialog's name)."""
    p = Path(path)
    return p if p.suffix.lower() == suffix else p.with_name(p.name + suffix)


def summary_path(path: Path) -> Path:
    """The session summary written beside an export: plots.png -> plots.session.json."""
    return path.with_name(path.stem + ".session.json")


def write_csv(history: list, path: Path) -> int:
    """Every kept step record, one row per hop (all models' columns); returns the row count."""
    rows = [csv_row(r) for r in history]
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    def write(f) -> None:
        text = io.TextIOWrapper(f, encoding="utf-8", newline="")
        w = csv.writer(text)                         # text cells a spreadsheet would run: prefixed
        w.writerow([safe_cell(k) for k in fields])
        w.writerows([safe_cell(row.get(k, "")) for k in fields] for row in rows)
        text.flush()
        text.detach()                    # atomic_write closes the file
    atomic_write(path, write)
    return len(rows)


def model_summaries(history: list) -> dict[str, dict]:
    """Per model over ``history``: what it is, what its weights are worth, what it answered and
    what it cost (means over the steps it ran)."""
    out: dict[str, dict] = {}
    for v in Tally.of(history).verdicts():          # the same verdict as the window and classify
        steps = [(r, r.models[v.name]) for r in history if v.name in r.models]
        r, m = steps[-1]
        out[v.name] = {"variant": m.variant, "layers": m.layers, "window": m.window,
                       "landmark_modes": sorted({s.landmark_mode for _, s in steps if s.landmark_mode}),
                       "weights": weights_text(m.trained, r.frontend), "steps": v.steps,
                       "top_genre": v.genre, "top_share": round(v.share, 4),
                       "top_mean_probability": round(v.confidence, 4),
                       "sda_flops_mean": round(statistics.fmean(s.flops["sda"] for _, s in steps)),
                       "model_flops_mean": round(statistics.fmean(s.flops["model"] for _, s in steps)),
                       "latency_ms_median": round(statistics.median(s.latency_ms for _, s in steps), 4)}
    return out


def session_summary(history: list, exported: Path) -> dict:
    """Where an export's numbers came from: source, front end, models, span, events."""
    first, last = history[0], history[-1]
    return {"exported": exported.name, "written": time.strftime("%Y-%m-%d %H:%M:%S"),
            "source": last.source, "frontend": last.frontend,
            "random_frontend": "RANDOM" in last.frontend,
            "steps": [first.step, last.step], "audio_time_s": [first.audio_time, last.audio_time],
            "dropped_hops": last.dropped_hops,
            "events": [f"step {r.step}: {e}" for r in history for e in r.events],
            "models": model_summaries(history)}


def write_summary(history: list, exported: Path) -> Path:
    path = summary_path(exported)
    atomic_write_json(path, session_summary(history, exported))
    return path


class NothingToExport(ValueError):
    """No step has been recorded yet."""


def save_csv(history: list, path: str) -> tuple[int, Path, Path]:
    """``history`` to ``path`` (.csv added if missing) and its session summary beside it ->
    (rows, CSV path, summary path). Raises NothingToExport, OSError."""
    if not history:
        raise NothingToExport("Nothing to export yet: start a source first.")
    out = with_suffix(path, ".csv")
    return write_csv(history, out), out, write_summary(history, out)


def save_png(image: QImage, history: list, path: str) -> Path:
    """``image`` (the plots) to ``path`` (.png added if missing) with a caption of source, front
    end and models, and a session summary beside it -> the PNG path. Raises OSError."""
    out = with_suffix(path, ".png")
    if history:
        image = captioned(image, caption(history))
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buffer, "PNG"):
        raise OSError(f"could not encode the plots as PNG for {out}")
    atomic_write(out, lambda f: f.write(bytes(data)))
    if history:
        write_summary(history, out)
    return out


def caption(history: list) -> str:
    """One line for an exported image: source, front end, models and their weights' worth."""
    last = history[-1]
    models = ", ".join(f"{n}" + ("" if w == "trained" else f" ({w})")
                       for n, w in ((n, weights_text(m.trained, last.frontend))
                                    for n, m in last.models.items()))
    return (f"Nystream · source {last.source} · front end {last.frontend} · steps "
            f"{history[0].step}-{last.step} · models: {models or 'none'}")


def captioned(image: QImage, text: str) -> QImage:
    """``image`` with ``text`` in a strip above it (wrapped to the image's width)."""
    font = QFont()
    font.setPointSize(10)
    width = max(image.width(), 400)
    probe = QPainter(image)
    probe.setFont(font)
    box = probe.boundingRect(0, 0, width - 16, 10_000, Qt.TextWordWrap, text)
    probe.end()
    out = QImage(width, image.height() + box.height() + 12, QImage.Format_ARGB32)
    out.fill(QColor("white"))
    p = QPainter(out)
    p.setFont(font)
    p.setPen(QColor("#7a1712") if "RANDOM" in text or "UNTRAINED" in text else QColor("black"))
    p.drawText(8, 6, width - 16, box.height(), Qt.TextWordWrap, text)
    p.drawImage(0, box.height() + 12, image)
    p.end()
    return out


def stacked(images: list[QImage]) -> QImage:
    """``images`` one above the other on white, as wide as the widest."""
    width = max((i.width() for i in images), default=1)
    out = QImage(width, max(sum(i.height() for i in images), 1), QImage.Format_ARGB32)
    out.fill(QColor("white"))
    p, y = QPainter(out), 0
    for image in images:
        p.drawImage(0, y, image)
        y += image.height()
    p.end()
    return out


# The window's export actions (MainWindow.export_csv / export_png): errors are said in the
# window, successes in its status bar.

def why(e: Exception, path: str) -> str:
    """One line: the resource that ran out and its file, else the error's own words."""
    if isinstance(e, OSError) and e.strerror:
        return resource_message(e, path) or f"{e.strerror}: {asked_for(e.filename or path)}"
    return str(e)


def export_csv(window, path: str) -> int:
    """Every kept step record of ``window`` to ``path`` (.csv added if missing), a session summary
    (JSON) beside it. Returns the row count (0: nothing written)."""
    try:
        rows, out, summary = save_csv(list(window.history), path)
    except (NothingToExport, OSError) as e:
        window.show_error(f"Could not export: {why(e, path)}")
        return 0
    window.statusBar().showMessage(f"Exported {rows} steps to {out} (and {summary.name})", 15000)
    return rows


def export_png(window, path: str) -> bool:
    """The visible plot panels of ``window`` stacked (genre, costs, ranking, spectrogram),
    captioned (source, front end, models; RANDOM / UNTRAINED marked), to ``path`` (.png added if
    missing), a session summary beside it."""
    panels = [w for w in (window.genre, window.cost, window.ranking, window.spectrogram) if w.isVisible()]
    try:
        out = save_png(stacked([w.grab().toImage() for w in panels]), list(window.history), path)
    except OSError as e:
        window.show_error(f"Could not export: {why(e, path)}")
        return False
    window.statusBar().showMessage(f"Saved the plots to {out}", 15000)
    return True
