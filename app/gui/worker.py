"""The processing worker: runs the Engine on a source in a QThread.

Threads: PortAudio's callback thread captures (audio/sources.py), this worker turns hops into
StepResults, and the GUI thread drains ``results`` on a timer at a bounded frame rate. The worker
never touches widgets; it hands results over through a deque (thread-safe appends and pops) and
reports errors and its end through queued signals.
"""
from __future__ import annotations

from collections import deque

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.runtime.engine import Engine
from audio.errors import AudioError


class EngineWorker(QObject):
    error = Signal(object)       # the exception that ended the run (typed; carries its hint)
    finished = Signal()

    def __init__(self, engine: Engine, make_source):
        super().__init__()
        self.engine, self.make_source = engine, make_source
        self.results: deque = deque(maxlen=4096)   # drained by the GUI thread
        self.source = None
        self._stopping = False

    @Slot()
    def run(self) -> None:
        try:
            self.source = self.make_source()
            if self._stopping:
                return
            for result in self.engine.run(self.source):
                self.results.append(result)
                if self._stopping:
                    break
        except AudioError as e:
            if not self._stopping:
                self.error.emit(e)
        except Exception as e:  # noqa: BLE001 - a crashed worker must still tell the window
            self.error.emit(e)
        finally:
            if self.source is not None:
                self.source.close()
            self.finished.emit()

    def stop(self) -> None:
        """Ask the run to end (from any thread): stops the engine and closes the source."""
        self._stopping = True
        self.engine.stop()
        if self.source is not None:
            self.source.close()

    def set_paused(self, paused: bool) -> None:
        if self.source is not None and hasattr(self.source, "paused"):
            (self.source.paused.set if paused else self.source.paused.clear)()


class WorkerThread:
    """A QThread running one EngineWorker; ``stop`` ends both within ``timeout`` seconds."""

    def __init__(self, worker: EngineWorker):
        self.worker, self.thread = worker, QThread()
        self.thread.setObjectName("nystream-engine")
        worker.moveToThread(self.thread)
        self.thread.started.connect(worker.run)
        worker.finished.connect(self.thread.quit)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 1.0) -> bool:
        """True if the thread ended in time."""
        self.worker.stop()
        self.thread.quit()
        return self.thread.wait(int(timeout * 1000))

    def running(self) -> bool:
        return self.thread.isRunning()
