"""The packed step log: what it gives back equals what the engine produced, and it stays within
its byte budget (the window's export history for an hour-long run)."""
import copy
import platform
import subprocess
import sys
from pathlib import Path

from tiny import tiny_model

from engine_helpers import engine_of
from app.runtime.steplog import StepLog
from audio.sources import DemoSource
from audio.vggish import build_embedder

ROOT = Path(__file__).resolve().parents[2]


def engine_results(seconds=4):
    engine = engine_of(build_embedder(random_seed=0),
                    {"continual": tiny_model("continual", n=8), "continual_nystrom": tiny_model("continual_nystrom", n=8),
                     "nystrom": tiny_model("nystrom", n=8)})
    results = list(engine.run([DemoSource(seconds=seconds)]))
    engine.set_landmark_mode("continual_nystrom", "fixed")     # a landmark change and its event
    results += list(engine.run([DemoSource(seconds=2)]))
    return results


def without_mel(r):
    r = copy.copy(r)
    r.mel = None
    return r


def test_unpacked_records_equal_the_engine_records():
    results = engine_results()
    assert any(r.events for r in results) and any(r.models["continual_nystrom"].landmark_mode == "fixed" for r in results)
    log = StepLog()
    for r in results:
        log.append(r)
    assert len(log) == len(results)
    assert list(log) == [without_mel(r) for r in results]          # dataclass equality, field by field
    assert log[-1] == without_mel(results[-1]) and log[0] == without_mel(results[0])
    assert log[-1].models["nystrom"].top == results[-1].models["nystrom"].top
    per_model_hop = log.nbytes / (len(results) * 3)
    assert per_model_hop < 120, per_model_hop                        # vs ~3 KB of Python objects


def test_the_oldest_hops_go_first_beyond_the_budget():
    results = engine_results(seconds=3)
    one = StepLog()
    one.append(results[0])
    log = StepLog(budget_bytes=5 * one.nbytes)
    for r in results:
        log.append(r)
    assert log.nbytes <= 5 * one.nbytes and 4 <= len(log) <= 5
    assert [r.step for r in log] == [r.step for r in results[-len(log):]]
    log.clear()
    assert len(log) == 0 and log.nbytes == 0 and list(log) == []



def heap_policy_in_a_fresh_process(call: str) -> str:
    """``call`` (a function of app/runtime/memory.py) run in a fresh interpreter, its result: the
    policy it sets is the process's for good, so not this worker's."""
    code = f"from app.runtime.memory import {call}; print({call}())"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_the_mmap_threshold_is_fixed_on_linux_glibc():
    """Set at start-up by every command run from the command line (app/cli.py); its effect on a
    long stream is measured in app/runtime/memory.py."""
    expected = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert heap_policy_in_a_fresh_process("fixed_mmap_threshold") == str(expected)


def test_a_many_streams_heap_is_set_on_linux_glibc():
    """Engine.warm() (serve, classify FILE FILE ..., bench --streams) sets it; the hop time
    and memory it gives are measured in app/runtime/memory.py."""
    expected = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert heap_policy_in_a_fresh_process("many_streams_heap") == str(expected)
