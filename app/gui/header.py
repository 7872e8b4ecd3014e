"""The top of the window: the error banner (click to dismiss), the focused model's genre in large
type, and which model it follows and whether the run has ended."""
from __future__ import annotations

from PySide6.QtGui import QFont
from PySide6.QtWidgets import QHBoxLayout, QLabel, QVBoxLayout, QWidget


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
        row.addWidget(self.top_label)
        row.addStretch(1)
        row.addWidget(self.focus_label)
        col.addLayout(row)
        self._ended = ""

    def show_error(self, message: str) -> None:
        self.banner.setText(message)
        self.banner.show()

    def show_genre(self, text: str, focus: str) -> None:
        """``text``: the focused model's genre line (table.label_text); ``focus``: its name."""
        self.top_label.setText(text)
        self.focus_label.setText(f"focused: {focus}{self._ended}")

    def show_no_model(self) -> None:
        """Every variant unticked: no stale genre stays on screen."""
        self.top_label.setText("—")
        self.focus_label.setText(f"no model running{self._ended}")

    def set_ended(self, how: str) -> None:
        """Mark the run as ended ('finished', 'stopped'); '' when a new run starts."""
        self._ended = f"  · {how}" if how else ""
        text = self.focus_label.text().split("  · ")[0]
        self.focus_label.setText(text + self._ended)
