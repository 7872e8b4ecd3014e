"""Helpers of the window tests."""


def wait_steps(qtbot, w, count, timeout=20000):
    qtbot.waitUntil(lambda: len(w.history) >= count, timeout=timeout)
