"""The engine in its own process (app/runtime/engine_process.py), against the in-process Engine
as its oracle: the same records, controls applied in call order, and either side's end seen by
the other (real processes, real signals)."""
import inspect
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from app.runtime.engine import Engine
from app.runtime.engine_process import EngineProcess, death_cause
from app.runtime.frontend_args import FrontEndSpec
from app.runtime.lineup import ModelSpec, shipped_checkpoints
from app.runtime.sources import SourceKind, SourceSpec
from audio_helpers import tone, write
from process_helpers import alive, gone_within
from models.transformer import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def collect(engine: EngineProcess, until, timeout: float = 60.0) -> list[tuple]:
    """Poll ``engine`` until ``until(messages)`` holds (or fail after ``timeout`` s)."""
    messages, t0 = [], time.monotonic()
    while not until(messages):
        assert time.monotonic() - t0 < timeout, f"timed out; got {[m[0] for m in messages][-5:]}"
        messages += engine.poll()
        time.sleep(0.02)
    return messages


def ended(messages) -> bool:
    return any(m[0] in ("finished", "died") for m in messages)


RECORD_UNIT = 1e-6 + 1e-12      # a record's probabilities are rounded to 6 decimals


@pytest.fixture
def engine():
    e = EngineProcess(torch_threads=1)       # one thread, as the in-process oracle here
    yield e
    e.close()


def models(device="cpu"):
    """A shipped trained model and an untrained 2-block continual Nyström, as specs."""
    trained = [p for p in shipped_checkpoints("musicnn") if p.stem.endswith("-continual_nystrom")][0]
    cfg = ModelConfig(variant="continual_nystrom", in_dim=50, window=12, layers=2, num_landmarks=3)
    return [("trained", ModelSpec(checkpoint=str(trained)), dict(trained=True, spacing=4, frontend="musicnn")),
            ("untrained", ModelSpec(config=cfg, seed=3), dict(spacing=None))]


def test_the_engine_process_streams_what_the_in_process_engine_computes(engine, tmp_path):
    path = write(tmp_path / "a.wav", np.concatenate([tone(1.5, 22050, f) for f in (220, 440, 880, 1760)]), 22050)
    source = SourceSpec(SourceKind.FILE, path, realtime=False)
    engine.start_run(FrontEndSpec("musicnn"), source, models())
    got = collect(engine, ended)
    remote = [m[1] for m in got if m[0] == "step"]
    assert [m[0] for m in got if m[0] not in ("step", "kernels")] == ["ready", "finished"]
    assert [m[1] for m in got if m[0] == "kernels"] == ["compiled (numba)"]    # (conftest prepared them)
    facts = got[0][1]
    assert (facts.name, facts.bands, facts.native_spacing) == ("musicnn", 96, 4)

    oracle = Engine(FrontEndSpec("musicnn").build())
    for name, spec, kwargs in models():
        oracle.add_model(name, spec, **kwargs)
    local = list(oracle.run([source.open()], warm=True))
    assert len(remote) == len(local) == 24
    for a, b in zip(remote, local):
        assert (a.step, a.audio_time, a.frontend, a.frontend_flops) == (b.step, b.audio_time, b.frontend, b.frontend_flops)
        np.testing.assert_array_equal(a.mel, b.mel)
        for name in ("trained", "untrained"):
            ma, mb = a.models[name], b.models[name]
            # the same code on one thread; a product's kernel may still take another path with
            # another memory layout (float32 rounding, ~1e-7 here), so a record's 6-decimal
            # rounding may fall either side: at most one unit of its last place apart
            assert max(abs(x - y) for x, y in zip(ma.probabilities, mb.probabilities)) <= RECORD_UNIT
            assert (ma.flops, ma.state_bytes, ma.warm, ma.spacing, ma.trained) == \
                   (mb.flops, mb.state_bytes, mb.warm, mb.spacing, mb.trained)
    assert remote[-1].models["untrained"].spacing == 4           # None: the front end's native spacing


def test_controls_cross_in_call_order_and_errors_come_back_as_lines(engine):
    engine.start_run(FrontEndSpec("musicnn"), SourceSpec(SourceKind.DEMO, realtime=False, seconds=30), [])
    cfg = ModelConfig(variant="continual_nystrom", in_dim=50, window=8, num_landmarks=2)
    engine.add_model("a", ModelSpec(config=cfg))
    engine.add_model("b", ModelSpec(config=cfg, seed=1))
    engine.reset_model("a")
    engine.set_landmark_mode("b", "fixed")              # too few tokens yet: an error line
    engine.remove_model("a")
    engine.add_model("c", ModelSpec(checkpoint="/nonexistent.pt"))
    engine.use_fixed_landmarks(False)
    got = collect(engine, ended)
    events = [e for m in got if m[0] == "step" for e in m[1].events]
    assert events[:4] == ["added a", "added b", "reset a", events[3]] and "wait for at least 2 tokens" in events[3]
    assert events[4] == "removed a" and events[5].startswith("error: ") and "nonexistent.pt" in events[5]
    assert events[6] == "b: continual landmarks"
    steps = [m[1] for m in got if m[0] == "step"]
    assert set(steps[-1].models) == {"b"} and len(steps) == 120


def test_a_run_that_cannot_open_its_source_says_why_and_ends(engine, tmp_path):
    engine.start_run(FrontEndSpec("musicnn"), SourceSpec(SourceKind.FILE, str(tmp_path / "missing.wav")), [])
    got = collect(engine, ended)
    kinds = [m[0] for m in got]
    assert kinds == ["ready", "error", "finished"]
    assert "missing.wav" in got[1][1] and "\n" not in got[1][1]
    assert engine.alive()                      # the process serves the next run
    engine.start_run(FrontEndSpec("musicnn"), SourceSpec(SourceKind.DEMO, realtime=False, seconds=1), [])
    assert [m[0] for m in collect(engine, ended) if m[0] not in ("step", "kernels")] == ["ready", "finished"]


def test_a_killed_engine_process_is_reported_once_with_its_signal(engine):
    engine.start_run(FrontEndSpec("musicnn"), SourceSpec(SourceKind.DEMO), [])
    collect(engine, lambda ms: any(m[0] == "step" for m in ms))
    os.kill(engine.process.pid, signal.SIGKILL)
    got = collect(engine, lambda ms: any(m[0] == "died" for m in ms), timeout=10)
    assert got[-1] == ("died", "the engine process was killed by SIGKILL (the system may have run out of memory)")
    assert not engine.alive() and engine.poll() == []
    engine.stop()                              # a dead engine ignores controls
    assert death_cause(3) == "the engine process exited with code 3"


def test_the_engine_process_exits_when_its_window_is_killed(tmp_path):
    """The parent is SIGKILLed (no chance to clean up): the engine notices and exits."""
    script = textwrap.dedent("""
        import sys, time
        from app.runtime.engine_process import EngineProcess
        from app.runtime.frontend_args import FrontEndSpec
        from app.runtime.sources import SourceKind, SourceSpec
        if __name__ == "__main__":
            e = EngineProcess()
            e.start_run(FrontEndSpec("musicnn"), SourceSpec(SourceKind.DEMO), [])
            while not any(m[0] == "step" for m in e.poll()):
                time.sleep(0.05)
            print(e.process.pid, flush=True)
            time.sleep(600)
    """)
    (tmp_path / "window.py").write_text(script)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "window.py")], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait()
        assert gone_within(child, 10), "the engine process outlived its window"
    finally:
        parent.kill()


def test_close_ends_the_process_and_the_control_api_is_the_engines():
    e = EngineProcess()
    e.start_run(FrontEndSpec("musicnn"), SourceSpec(SourceKind.DEMO), [])
    collect(e, lambda ms: any(m[0] == "step" for m in ms))     # started and streaming
    t0 = time.monotonic()
    e.close()                                  # asked to exit: it ends its run and exits at once
    assert not e.process.is_alive() and e.process.exitcode == 0 and time.monotonic() - t0 < 2.0
    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
    for name in ("add_model", "remove_model", "reset_model", "set_landmark_mode", "use_fixed_landmarks", "stop"):
        assert params(getattr(EngineProcess, name)) == params(getattr(Engine, name)), name
