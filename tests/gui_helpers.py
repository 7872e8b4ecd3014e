"""Helpers of the window tests."""


def wait_steps(qtbot, w, count, timeout=None, model=None):
    """Until the window holds ``count`` steps (with ``model``: steps of that model): the demo and
    files are paced in real time (0.25 s a step), after the engine process starts (seconds on a
    loaded 2-core host)."""
    timeout = 30000 + 250 * count if timeout is None else timeout
    held = (lambda: len(w.history)) if model is None else (lambda: sum(model in r.models for r in w.history))
    qtbot.waitUntil(lambda: held() >= count, timeout=timeout)
