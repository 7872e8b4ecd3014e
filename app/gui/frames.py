"""The window's frames: what arrived from the engine drawn at the timer's rate (at most
FRAME_MS apart), the plots on every frame with new hops, the ranking, the table and the status
bar at most once every ``slow_panels_s``, panels out of sight not at all. Each frame's time is
recorded (per panel, and the window thread's CPU up to the next tick, Qt's painting included).
Functions of the MainWindow (``self``), bound in window.py."""
from __future__ import annotations

import time

from audio.melspec import HOPS_PER_MINUTE

from .table import preferred_focus, status_texts

PANELS = ("genre", "cost", "spectrogram", "ranking", "table")


def in_sight(widget) -> bool:
    """Shown and not hidden behind another tab or scrolled away (a tabbed dock stays 'visible';
    a plot's pixels are its viewport's)."""
    area = widget.viewport() if hasattr(widget, "viewport") else widget
    return widget.isVisible() and not area.visibleRegion().isEmpty()


def redraw(self) -> None:
    """The timer's tick: draw what arrived; the CPU of the last frame that drew is recorded."""
    cpu = time.thread_time()
    if self._drew:                 # the last frame's CPU, Qt's painting after it included
        self.frame_cpu_ms.append((cpu - self._cpu_at) * 1e3)
    self._cpu_at = cpu
    self._drew = draw(self, self.drain())


def draw(self, new: list) -> bool:
    """Draw the hops in ``new``: the genre and cost plots now (the cost bands), the ranking, the
    table and the status bar at most once a second; panels out of sight (a tab behind another)
    are skipped.
    False if there was nothing to draw."""
    if not new:
        return False
    t0 = time.perf_counter()
    for r in new:
        self.history.append(r)
        self.recent.append(r)
        self.header.push(r)
        self.genre.push(r, self.header.smoother.state)
        if r.mel is not None:
            self.spectrogram.push_mel(r.mel)
            r.mel = None                # the spectrogram keeps its own last 10 s
    events = [e for r in new for e in r.events]    # control feedback: the last of each kind
    errors = [e for e in events if e.startswith("error")]
    if errors:
        self.show_error(errors[-1] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
    if len(errors) < len(events):
        self.statusBar().showMessage([e for e in events if not e.startswith("error")][-1], 15000)
    now = time.monotonic()
    for r in new:
        if r.ready_time:
            self.delay_ms.append((now - r.ready_time) * 1e3)
    last = new[-1]
    models = list(last.models)
    update_focus(self, last, models)
    focus = self.focus_box.currentText()
    recent = list(self.recent)
    slow = now - self._slow_at >= self.slow_panels_s or len(self.recent) <= len(new)
    if slow:
        self._slow_at = now
    for name, draw, due in (
            ("genre", lambda: self.genre.redraw(recent, focus), True),
            ("cost", lambda: self.cost.redraw(recent, models, bands=slow), True),
            ("spectrogram", self.spectrogram.redraw, in_sight(self.spectrogram)),
            ("ranking", lambda: self.ranking.redraw(recent, models, self.cost.flops_kind),
             slow and in_sight(self.ranking)),
            ("table", lambda: self.table.show_steps(recent[-HOPS_PER_MINUTE:]), slow and in_sight(self.table))):
        if due:
            t = time.perf_counter()
            draw()
            self.panel_ms[name].append((time.perf_counter() - t) * 1e3)
    if focus in last.models:
        self.header.show_focus(last, focus)
    elif not models:
        self.header.show_no_model()
    if slow:
        for key, text in status_texts(recent[-HOPS_PER_MINUTE:], self.paused, self.device,
                                      self.delay_ms).items():
            self.status[key].setText(text)
    self.frame_ms.append((time.perf_counter() - t0) * 1e3)
    return True


def update_focus(self, last, models: list[str]) -> None:
    """Keep the focus list equal to the running models; prefer a trained continual Nyström."""
    focus = self.focus_box.currentText()
    if [self.focus_box.itemText(i) for i in range(self.focus_box.count())] == models:
        return
    self.focus_box.blockSignals(True)
    self.focus_box.clear()
    self.focus_box.addItems(models)
    chosen = preferred_focus(last.models, focus)
    if chosen is not None:
        self.focus_box.setCurrentText(chosen)
    self.focus_box.blockSignals(False)
