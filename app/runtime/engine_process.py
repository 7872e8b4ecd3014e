"""The engine in its own process, for the live window.

The window process only draws; source capture (the microphone is opened here), the front end and
every model's step run in another process, so no paint ever holds up a hop and the two never
share a heap or a GIL. Engine processes are forked from one server process (multiprocessing's
forkserver) that imported torch and the engine and loaded the compiled kernels once, and never
Qt: the first costs a fresh interpreter's start, each later one (Start after a killed engine) a
fork. ``EngineProcess`` is
driven like an ``Engine``: the same control methods
(models are given as ``ModelSpec``s and built in the engine process), sent in call order over one
pipe and applied there under the same control budget. Results come back as packed step records
(app/runtime/steplog.py StepCodec, ~0.1 KB per model) with the hop's log-mel frames.

Either side survives the other's end: the window sees the engine process die (``poll`` says so,
with the signal or exit code), and the engine process exits when its parent is gone (its pipe
reads end of file, and a watchdog thread waits on the parent's pid).

The window starts its engine process when it opens and asks it to ``prepare`` the front end it
will start with: the front end is built, its compiled push loaded (or its build started) and the
models' compiled kernels requested (app/runtime/kernels.py), so that Start finds them ready.

Messages, window -> engine: ("prepare", FrontEndSpec), ("run", run_id, FrontEndSpec, SourceSpec,
[(name, ModelSpec, kwargs)]), ("call", method, args, kwargs), ("pause", on), ("speed", x), ("stop",),
("exit",).
Engine -> window, each tagged with its run_id: ("prepared", 0, seconds since the process began),
("ready", id, front-end facts), ("warn", id, text), ("step", id, new kinds, packed hop, mel),
("push", id, how the front end's network runs, or None: on its first hop and whenever it
changes), ("kernels", id, how the models' steady steps run, likewise), ("error", id, text),
("finished", id).
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass

from .frontend_args import FrontEndSpec
from .lineup import ModelSpec
from .memory import glibc_call
from .sources import SourceSpec
from .steplog import StepCodec

GIL_SWITCH_S = 1e-4           # see share_the_gil()
WATCH_PARENT_S = 0.5          # how often the engine process checks that its window still runs (no pidfd)
PR_SET_NAME = 15              # prctl option (linux/prctl.h)
OUTBOX = 4096                 # messages the engine process holds for a window that reads slowly
PRELOAD = ("torch", "app.runtime.engine", "audio.frontends",   # what the fork server imports once,
           "app.runtime.kernels_preload")                  # and the compiled kernels it loads
ENGINE_THREADS = 1            # torch threads of the engine process: a hop's ~150 small torch calls
                              # gain nothing from a second thread, and on busy cores each call
                              # would wait for both of its threads to be scheduled


def share_the_gil() -> None:
    """Let the processing thread get the GIL back sooner while another thread of the engine
    process (the control thread's k-means fit, the pipe) runs: each of the ~150 small torch
    calls of a musicnn hop releases the GIL and must wait to take it back."""
    sys.setswitchinterval(GIL_SWITCH_S)


def engine_context():
    """The multiprocessing context engine processes start in: forked from a server process that
    imported PRELOAD (torch, the engine) once; it ends with this process."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


@dataclass(frozen=True)
class FrontEndFacts:
    """What the window needs to know of the engine's front end (for the spectrogram, labels)."""
    name: str
    description: str
    bands: int
    mel_levels: tuple
    frame_ms: float
    native_spacing: int
    device: str


def death_cause(exitcode: int | None) -> str:
    """One line on how a process ended, from its exit code."""
    if exitcode is None:
        return "the engine process stopped answering"
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        oom = " (the system may have run out of memory)" if -exitcode == signal.SIGKILL else ""
        return f"the engine process was killed by {name}{oom}"
    return f"the engine process exited with code {exitcode}"


class EngineProcess:
    """An engine process serving one run at a time; the window's handle on it.

    Control methods as ``Engine``'s (add_model, remove_model, reset_model, set_landmark_mode,
    use_fixed_landmarks, stop); ``start_run`` begins a run, ``poll`` returns what arrived.
    """

    def __init__(self, torch_threads: int | None = None):
        """``torch_threads``: the engine process's torch CPU threads (None: torch's default)."""
        ctx = engine_context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, os.getpid(), torch_threads, dict(os.environ)),
                                   name="nystream-engine", daemon=True)
        self.process.start()
        child.close()             # only the engine process holds its end: its reads see our end
        self.run_id = 0
        self._codec = StepCodec()
        self.ended = False        # the process is gone (its cause is said once by poll)

    # ------------------------------------------------------------------ runs
    def prepare(self, frontend: FrontEndSpec) -> None:
        """Build ``frontend`` and ready the compiled forms before any run (poll says
        ("prepared", seconds) when done)."""
        self._send(("prepare", frontend))

    def start_run(self, frontend: FrontEndSpec, source: SourceSpec, models) -> int:
        """Begin a run (ending the one before): ``models`` is [(name, ModelSpec, add_model
        keywords)], added in order before the first hop. Returns the run's id."""
        self.run_id += 1
        self._codec = StepCodec()
        self._send(("run", self.run_id, frontend, source, list(models)))
        return self.run_id

    def set_paused(self, paused: bool) -> None:
        self._send(("pause", paused))

    def set_speed(self, speed: float) -> None:
        """Play the run's file or demo at ``speed`` from its next hop (a microphone keeps its own)."""
        self._send(("speed", speed))

    def stop(self) -> None:
        """End the run after the hop in progress (closes its source)."""
        self._send(("stop",))

    # ------------------------------------------------------------------ Engine's control API
    def add_model(self, name: str, model: ModelSpec, trained: bool = False, *, spacing: int | None = 1,
                  frontend: str | None = None, classes=None) -> None:
        self._call("add_model", name, model, trained, spacing=spacing, frontend=frontend, classes=classes)

    def remove_model(self, name: str) -> None:
        self._call("remove_model", name)

    def reset_model(self, name: str | None = None) -> None:
        self._call("reset_model", name)

    def set_landmark_mode(self, name: str, mode: str) -> None:
        self._call("set_landmark_mode", name, mode)

    def use_fixed_landmarks(self, on: bool) -> None:
        self._call("use_fixed_landmarks", on)

    def _call(self, method: str, *args, **kwargs) -> None:
        self._send(("call", method, args, kwargs))

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except (OSError, EOFError, BrokenPipeError):
            pass                  # the process is gone: poll() says so

    # ------------------------------------------------------------------ results
    def poll(self) -> list[tuple]:
        """What arrived for the current run, in order: ("step", StepResult) with its ``mel``,
        ("prepared", seconds) (before the first run), ("ready", FrontEndFacts), ("push", text or None), ("warn", text), ("error", text), ("finished",), and once,
        if the process died, ("died", cause)."""
        out = []
        try:
            while self.conn.poll():
                kind, run_id, *rest = self.conn.recv()
                if run_id != self.run_id and kind != "prepared":
                    continue                  # an earlier run's last messages
                if kind == "step":
                    kinds, packed, mel = rest
                    self._codec.learn(kinds)
                    r = self._codec.unpack(packed)
                    r.mel = mel
                    out.append(("step", r))
                else:
                    out.append((kind, *rest))
        except (EOFError, OSError):
            pass
        if not self.ended and not self.process.is_alive():
            self.ended = True
            out.append(("died", death_cause(self.process.exitcode)))
        return out

    def alive(self) -> bool:
        return not self.ended and self.process.is_alive()

    def close(self, timeout: float = 2.0) -> None:
        """End the process: asked first, then terminated, then killed."""
        self._send(("exit",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)
        self.conn.close()


# ---------------------------------------------------------------------- the engine process
class Outbox:
    """Messages to the window, sent by a thread of their own: a window that reads slowly never
    makes the processing thread wait (up to OUTBOX messages are held)."""

    def __init__(self, conn):
        self.conn = conn
        self.queue: queue.Queue = queue.Queue(OUTBOX)
        threading.Thread(target=self._send_all, name="engine-outbox", daemon=True).start()

    def put(self, message) -> None:
        try:
            self.queue.put_nowait(message)
        except queue.Full:
            pass                  # the window stopped reading for ~17 minutes of hops

    def _send_all(self) -> None:
        while True:
            message = self.queue.get()
            try:
                self.conn.send(message)
            except (OSError, EOFError, BrokenPipeError):
                os._exit(0)       # the window is gone


class Run:
    """One run in the engine process: the front end, the Engine (its one stream: the source), the
    processing thread."""

    def __init__(self, run_id: int, frontend, source: SourceSpec, engine, outbox: Outbox):
        self.run_id, self.frontend, self.spec, self.engine, self.outbox = run_id, frontend, source, engine, outbox
        self.source = None
        self.stopping = False
        self.codec = StepCodec()
        self.thread = threading.Thread(target=self._run, name="engine-run", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from audio.errors import AudioError, with_hint
        from app.runtime.kernels import KERNELS
        try:
            self.source = self.spec.open()
            if self.stopping:
                return
            said = said_kernels = None                   # (the window starts from None at 'ready')
            for r in self.engine.run([self.source], warm=True):
                seen = len(self.codec.kinds)
                packed = self.codec.pack(r)
                self.outbox.put(("step", self.run_id, self.codec.kinds[seen:], packed, r.mel))
                push = self.frontend.push_status()       # how its network runs, when that changes
                if push != said:
                    said = push
                    self.outbox.put(("push", self.run_id, push))
                kernels = KERNELS.words()                # how the models' steady steps run, likewise
                if kernels != said_kernels:
                    said_kernels = kernels
                    self.outbox.put(("kernels", self.run_id, kernels))
                if self.stopping:
                    break
            for _, why in self.engine.errors:        # the stream left early (a model's non-finite answer)
                if not self.stopping:
                    self.outbox.put(("error", self.run_id, why))
        except AudioError as e:
            if not self.stopping:
                self.outbox.put(("error", self.run_id, with_hint(e)))
        except Exception as e:  # noqa: BLE001 - the window must hear why its run ended
            self.outbox.put(("error", self.run_id, f"processing stopped: {type(e).__name__}: {e}"))
        finally:
            if self.source is not None:
                self.source.close()
            self.outbox.put(("finished", self.run_id))

    def pause(self, on: bool) -> None:
        if self.source is not None and hasattr(self.source, "paused"):
            (self.source.paused.set if on else self.source.paused.clear)()

    def set_speed(self, speed: float) -> None:
        from audio.sources import check_speed
        if self.source is not None and hasattr(self.source, "speed"):
            self.source.speed = check_speed(speed)

    def stop(self, timeout: float = 2.0) -> None:
        self.stopping = True
        self.engine.stop()
        if self.source is not None:
            self.source.close()
        self.thread.join(timeout)


def watch_parent(parent_pid: int) -> None:
    """Exit when the window's process is gone (killed, even with SIGKILL): its pidfd becomes
    readable (Linux 5.3+), or else its pid is looked for every WATCH_PARENT_S."""
    import select
    try:
        fd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):
        fd = None
    while True:
        if fd is not None:
            select.select([fd], [], [])
            os._exit(0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass
        time.sleep(WATCH_PARENT_S)


def name_this_process(name: str) -> None:
    """The name ``top`` and ``ps -e`` show for this process (Linux; a no-op elsewhere)."""
    glibc_call("prctl", PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def prepare(frontends: dict, spec: FrontEndSpec) -> None:
    """``spec``'s front end built (musicnn: VGGish may download) and its one-stream push asked
    for (loaded, or built in the background), and the models' compiled kernels requested."""
    from app.runtime.kernels import KERNELS, set_up_numba
    set_up_numba()                                  # now, not beside the hops a build's end loads them into
    KERNELS.request()
    if spec.name == "musicnn" and spec not in frontends:
        try:
            frontends[spec] = spec.build()
        except Exception:  # noqa: BLE001 - the run builds it again and says why
            return
    if spec in frontends and hasattr(frontends[spec], "stream"):
        frontends[spec].stream()                    # (the compiled push: musicnn, one stream, CPU)


def serve(conn, parent_pid: int, torch_threads: int | None = None, environ: dict | None = None) -> None:
    """The engine process's main loop: one message at a time, in the order the window sent them.
    ``environ``: the window's environment when it started this process (the fork server's is
    the one it had when the server started)."""
    began = time.monotonic()
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl+C in the terminal is the window's to handle
    threading.Thread(target=watch_parent, args=(parent_pid,), name="engine-watchdog", daemon=True).start()
    name_this_process("nystream-engine")
    share_the_gil()
    if torch_threads:
        import torch
        torch.set_num_threads(torch_threads)
    from audio.errors import AudioError, with_hint

    from .engine import Engine

    outbox = Outbox(conn)
    frontends: dict = {}            # FrontEndSpec -> its built front end (kept between runs)
    run: Run | None = None
    prepared: threading.Thread | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break                   # the window is gone
        kind = message[0]
        if kind == "prepare":                       # on a thread: an "exit" meanwhile is answered at once
            def preparing(spec=message[1]):
                prepare(frontends, spec)
                outbox.put(("prepared", 0, time.monotonic() - began))
            prepared = threading.Thread(target=preparing, name="engine-prepare", daemon=True)
            prepared.start()
        elif kind == "run":
            if prepared is not None:
                prepared.join()                     # its front end, then the run's
            _, run_id, fe_spec, source, models = message
            if run is not None:
                run.stop()
            run = None
            try:
                fe = frontends.get(fe_spec)
                if fe is None:
                    def warn(e, run_id=run_id):
                        outbox.put(("warn", run_id, f"{e}\nRunning with RANDOM VGGish weights: predictions "
                                                    f"are not meaningful. {e.hint}"))
                    fe = frontends[fe_spec] = fe_spec.build(on_missing=warn)
            except Exception as e:  # noqa: BLE001 - said to the window; the process serves on
                outbox.put(("error", run_id, with_hint(e) if isinstance(e, AudioError)
                            else f"the front end could not start: {type(e).__name__}: {e}"))
                outbox.put(("finished", run_id))
                continue
            outbox.put(("ready", run_id, FrontEndFacts(fe.name, fe.description, fe.bands, tuple(fe.mel_levels),
                                                       fe.frame_ms, fe.native_spacing, str(fe_spec.device))))
            engine = Engine(fe)
            for name, spec, kwargs in models:
                engine.add_model(name, spec, **kwargs)
            run = Run(run_id, fe, source, engine, outbox)
        elif kind == "call" and run is not None:
            _, method, args, kwargs = message
            getattr(run.engine, method)(*args, **kwargs)
        elif kind == "pause" and run is not None:
            run.pause(message[1])
        elif kind == "speed" and run is not None:
            run.set_speed(message[1])
        elif kind == "stop" and run is not None:
            run.stop()
            run = None
        elif kind == "exit":
            break
    if run is not None:
        run.stop(1.0)
    os._exit(0)       # skip interpreter teardown: nothing is left to flush, and torch's is slow
