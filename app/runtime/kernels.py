"""The compiled kernels made ready beside a running engine, never on its hop path.

numba compiles a kernel on its first call (tens of seconds for all of them on 2 cores) and holds
the calling thread's GIL for up to a quarter of a second at a time while it does; loading them
from its cache takes a fraction of a second and, once numba's CPU target is set up, holds the
GIL for about a millisecond at a time. So an engine never compiles: ``Kernels.request()`` (before the first hop) either
sets numba's target up and loads the kernels at once (the cache holds them: its marker is there;
every hop is then compiled from the first), or starts a process that compiles them into the
cache (``python -m app.runtime.kernels``, at a low priority) and, when it ends, loads them in a
thread beside the hops (numba's target set up there too, unless ``set_up_numba`` ran before the
hops began, as the window's engine process has it do while the user chooses).
Until ``ready()``, a model's streams take the torch step (models/stream/batch.py ``kernels``),
which equals the compiled one within float32 rounding; at the first step after, they take the
compiled one. ``compile_all`` steps a small scratch model of every kind the backend takes
(1 and 2 blocks; continual, continual and fixed landmarks) and the recomputing Nyström
pseudo-inverse: kernels are typed by dtype and rank, not size, so that covers every model.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from models.fused.numba_cache import HERE, ROOT, STATE_FILES, cache_root, set_up_numba

SOURCES = ("kernels.py", "blocks.py", "pinv.py", "backend.py")   # models/fused/
NICE = 10                      # the compiling process's priority: below the engine's hops, not starved


def digest() -> str:
    """What numba's cache entries are valid for: the kernels' sources, the state they read and
    what ``compile_all`` compiles (content, and the size and time numba checks), numba, Python
    and this CPU."""
    import numba
    from llvmlite import binding
    h = hashlib.sha256()
    for path in (*(HERE / name for name in SOURCES), Path(__file__).resolve(), *STATE_FILES):
        st = path.stat()
        h.update(path.read_bytes() + f"{st.st_size} {st.st_mtime_ns}".encode())
    h.update(f"{numba.__version__} {sys.version_info[:2]} {binding.get_host_cpu_name()}".encode())
    return h.hexdigest()[:16]


def marker(root: Path) -> Path:
    """The file that says every kernel of this code is in numba's cache at ``root``."""
    return root / f"kernels-{digest()}.ready"


def compile_all() -> None:
    """Every kernel the backend calls, compiled or loaded from numba's cache in this thread: a
    scratch model of each kind steps two streams through its warm-up into steady steps."""
    import torch

    from models.stream.batch import StreamBatch, steps_to_steady
    from models.transformer import ModelConfig, build_model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layers in (1, 2):
            for variant, mode in (("continual", None), ("continual_nystrom", None), ("continual_nystrom", "fixed")):
                cfg = ModelConfig(variant=variant, in_dim=5, d_model=8, heads=2, ff_dim=12, window=6,
                                  num_landmarks=2, layers=layers, num_classes=3)
                model = build_model(cfg, seed=0).eval()
                if mode == "fixed":
                    for block in model.blocks:
                        block.attn.set_fixed_landmarks(torch.randn(2, 2, 4, generator=g), torch.randn(2, 2, 4, generator=g))
                batch = StreamBatch(model, 2, fused=True)
                slots = [batch.join(), batch.join()]
                for _ in range(steps_to_steady(cfg) + 2):
                    batch.step(slots, torch.rand(2, cfg.in_dim, generator=g))
        recompute = build_model(ModelConfig(variant="nystrom", in_dim=5, d_model=8, heads=2, ff_dim=12, window=6,
                                            num_landmarks=2, num_classes=3), seed=0).eval()
        recompute(torch.rand(2, 6, 5, generator=g))


class Kernels:
    """This process's compiled kernels: ``request()`` makes them ready (at most once: loaded at
    once from the cache, else built in the background), ``ready()`` says whether they are (and
    looks at a build at most once a second),
    ``wait()`` waits; ``status``: 'idle', 'building', 'loading', 'compiled' or 'eager: REASON'.
    ``numba_cache``: the build process's ``NUMBA_CACHE_DIR`` (default: this process's cache,
    models/fused/numba_cache.py)."""

    LOOK_S = 1.0

    def __init__(self, numba_cache: Path | None = None):
        self.env = {"NUMBA_CACHE_DIR": str(numba_cache)} if numba_cache is not None else {}
        self.root = Path(numba_cache) / "nystream" if numba_cache is not None else cache_root()
        self.status = "idle"
        self.build: subprocess.Popen | None = None
        self.next_look = 0.0
        self._loaded = threading.Event()
        self._lock = threading.Lock()

    def request(self) -> None:
        """Make the kernels ready, unless that has begun (any thread): loaded here where the
        cache has them (under a second), else built in the background."""
        with self._lock:
            if self.status != "idle":
                return
            if marker(self.root).exists():
                self._load(here=True)
            else:
                self._start_build()

    def ready(self) -> bool:
        if self._loaded.is_set():
            return True
        self.look()
        return self._loaded.is_set()

    def _start_build(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / "kernels-build.log", "w") as log:
                self.build = subprocess.Popen([sys.executable, "-m", "app.runtime.kernels"], stdout=subprocess.DEVNULL,
                                              stderr=log, cwd=ROOT, env={**os.environ, **self.env})
            self.status = "building"
        except OSError as e:                               # an unwritable cache, no process to spare
            self.status = f"eager: the compiled kernels could not be built ({e})"

    def look(self) -> None:
        """Where a build runs: see whether it ended (at most once a second); load what it built."""
        now = time.monotonic()
        if self.build is None or now < self.next_look:
            return
        self.next_look = now + self.LOOK_S
        code = self.build.poll()
        if code is None:
            return
        self.build = None
        if code == 0 and marker(self.root).exists():
            self._load()
            return
        try:
            lines = [line.strip() for line in (self.root / "kernels-build.log").read_text(errors="replace").splitlines()
                     if line.strip()]
        except OSError:
            lines = []
        self.status = f"eager: the compiled kernels could not be built ({lines[-1][:200] if lines else f'exit status {code}'})"

    def _load(self, here: bool = False) -> None:
        """Load (or compile, where the cache lacks one) every kernel: in this thread, or in a
        thread of its own beside the hops."""
        self.status = "loading"

        def load():
            try:
                set_up_numba()
                compile_all()
            except Exception as e:  # noqa: BLE001 - the torch step serves on; status says why
                self.status = f"eager: the compiled kernels could not be loaded ({type(e).__name__}: {e})"
                return
            self.status = "compiled"
            self._loaded.set()
        if here:
            load()
        else:
            threading.Thread(target=load, name="kernels-load", daemon=True).start()

    def wait(self, timeout: float = 900.0) -> str:
        """Until the kernels are ready or cannot be, at most ``timeout`` s; the status."""
        deadline = time.monotonic() + timeout
        while self.status in ("building", "loading") and time.monotonic() < deadline:
            time.sleep(0.05)
            self.look()
        return self.status

    WORDS = {"compiled": "compiled (numba)", "building": "the torch step while its compiled kernels build "
             "in the background (once per machine)", "loading": "the torch step while its compiled kernels load"}

    def words(self) -> str | None:
        """``status`` as a user reads it (None: never requested)."""
        self.look()
        return None if self.status == "idle" else self.WORDS.get(self.status, self.status)


KERNELS = Kernels()            # numba's dispatchers are the process's: so is their readiness


def prepare() -> str:
    """The kernels in this process's cache, compiled here where the marker says they are not
    (``nystream prepare``, the tests); what happened, in words."""
    set_up_numba()
    if marker(cache_root()).exists():
        return "ready (cached)"
    build()
    return f"compiled into {cache_root()}"


def build() -> None:
    """Compile every kernel into numba's cache, then write the marker beside it (the build
    process, and ``prepare``)."""
    compile_all()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    path = marker(root)
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(f"numba kernels of models/fused/, built {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    part.replace(path)
    for old in root.glob("kernels-*.ready"):
        if old != path:
            old.unlink(missing_ok=True)


if __name__ == "__main__":                                 # Kernels' build
    os.nice(NICE)
    t0 = time.perf_counter()
    build()
    print(f"built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
