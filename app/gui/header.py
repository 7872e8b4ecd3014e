"""The top of the window: the error banner (click to dismiss), the focused model's genre in large
type (smoothed over a few seconds, app/runtime/verdict.py) with the runners-up, which model it
follows, whether the run has ended, and when a file ends the model's verdict over the file."""
from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QHBoxLayout, QLabel, QVBoxLayout, QWidget

from app.runtime.verdict import Smoother, Tally, top_k

from .table import label_text


class Header(QWidget):
    def __init__(self):
        super().__init__()
        col = QVBoxLayout(self)
        col.setContentsMargins(0, 0, 0, 0)
        self.banner = QLabel()
        self.banner.setWordWrap(True)
        self.banner.setStyleSheet("background:#fde2e1;color:#7a1712;padding:6px;border:1px solid #e0a09c;")
        self.banner.hide()
        self.banner.mousePressEvent = lambda e: self.banner.hide()
        col.addWidget(self.banner)
        row = QHBoxLayout()
        self.top_label = QLabel("—")
        big = QFont()
        big.setPointSize(26)
        big.setBold(True)
        self.top_label.setFont(big)
        self.focus_label = QLabel("")
        self.runners_up = QLabel("")           # the next two genres, smoothed
        self.runners_up.setStyleSheet("color:#555;font-size:14pt;")
        for label in (self.top_label, self.runners_up, self.focus_label):
            label.setWordWrap(True)             # long texts wrap: they never widen the window
        row.addWidget(self.top_label)
        row.addWidget(self.runners_up, 1)
        col.addLayout(row)
        col.addWidget(self.focus_label)         # a line of its own: it never widens the window
        self.verdict = QLabel("")              # a finished file's verdict (rich text, names escaped)
        self.verdict.setTextFormat(Qt.RichText)
        self.verdict.setStyleSheet("font-size:13pt;")
        self.verdict.hide()
        col.addWidget(self.verdict)
        self.smoother = Smoother(5.0)
        self._ended = ""

    def show_error(self, message: str) -> None:
        self.banner.setText(message)
        self.banner.show()

    def push(self, result) -> None:
        """Every model's probabilities of one StepResult into the smoothed ones."""
        for name, m in result.models.items():
            self.smoother.update(name, m.probabilities)

    def show_focus(self, last, focus: str) -> None:
        """The focused model's smoothed genre and confidence, what its weights are worth, and the
        two runners-up. last: the newest StepResult."""
        m = last.models[focus]
        (genre, p), *rest = top_k(m.classes, self.smoother.state.get(focus, m.probabilities))
        self.top_label.setText(label_text(genre, p, m.trained, last.frontend))
        self.runners_up.setText("   then " + ", ".join(f"{g} {100 * q:.0f}%" for g, q in rest))
        smooth = f", smoothed over {self.smoother.seconds:g} s" if self.smoother.seconds > 0 else ""
        self.focus_label.setText(f"focused: {focus}{smooth}{self._ended}")

    def show_verdict(self, history: list, focus: str) -> None:
        """The verdict of ``focus`` over ``history`` (a finished file), or hide it."""
        verdicts = {v.name: v for v in (Tally.of(history).verdicts() if history else [])}
        v = verdicts.get(focus)
        self.verdict.setVisible(v is not None)
        if v is not None:
            self.verdict.setText(f"Verdict for the file ({html.escape(focus)}): <b>{html.escape(v.genre)}</b>, on top in "
                                 f"{100 * v.share:.0f}% of {v.steps} steps, mean probability "
                                 f"{100 * v.confidence:.0f}%")

    def show_no_model(self) -> None:
        """Every variant unticked: no stale genre stays on screen."""
        self.top_label.setText("—")
        self.runners_up.setText("")
        self.focus_label.setText(f"no model running{self._ended}")

    def start_run(self) -> None:
        """A new run: no smoothed history, no verdict, no end mark."""
        self.smoother.reset()
        self.verdict.hide()
        self.set_ended("")

    def end_run(self, how: str, history: list, focus: str) -> str:
        """A run ended ``how`` ('finished: the source ended', 'stopped', ...): mark it, show the
        focused model's verdict over a finished file; returns the status bar's line."""
        self.set_ended(how.split(":")[0])
        self.show_verdict(history if how.startswith("finished") else [], focus)
        last = history[-1] if history else None
        return how.capitalize() + (f" after {last.step + 1} hops ({last.audio_time:.1f} s of audio)"
                                   if last else "")

    def set_ended(self, how: str) -> None:
        """Mark the run as ended ('finished', 'stopped'); '' when a new run starts."""
        self._ended = f"  · {how}" if how else ""
        text = self.focus_label.text().split("  · ")[0]
        self.focus_label.setText(text + self._ended)
