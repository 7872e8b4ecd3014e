"""Helpers of the window tests."""

# How long a window test waits for what it expects, in ms: generous, because a timeout only sets
# how long a failing test waits, and a 2-core host twice as slow as a quick one, with the other
# test worker busy, takes seconds to start an engine process (each loads torch and the models).
WAIT_MS = 30000
SPEED = 4.0         # the test windows play their file or the demo at 4x: a hop every 62.5 ms, the
                    # window's real-time path at a quarter of the wait


def wait_steps(qtbot, w, count, timeout=None, model=None):
    """Until the window holds ``count`` steps (with ``model``: steps of that model): the demo and
    files are paced in real time (0.25 s a step at 1x), after the engine process starts (seconds
    on a loaded 2-core host)."""
    timeout = WAIT_MS + 250 * count if timeout is None else timeout
    held = (lambda: len(w.history)) if model is None else (lambda: sum(model in r.models for r in w.history))
    qtbot.waitUntil(lambda: held() >= count, timeout=timeout)
