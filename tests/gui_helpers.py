"""Helpers of the window tests."""


def wait_steps(qtbot, w, count, timeout=None):
    """Until the window holds ``count`` steps: the demo and files are paced in real time (0.25 s a
    step), after the engine process starts (seconds on a loaded 2-core host)."""
    timeout = 30000 + 250 * count if timeout is None else timeout
    qtbot.waitUntil(lambda: len(w.history) >= count, timeout=timeout)
