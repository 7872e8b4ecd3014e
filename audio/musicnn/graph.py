"""The continual musicnn push of one hop as one pure function of the caches, and the single
stream that runs it compiled.

``PushGraph``: MusicnnBatch's push (audio/musicnn/batch.py) for G streams that each bring k new
frames, its caches in patch order (no ring, no host indices) in and out: the shape an inference
engine compiles. It calls the batch's own pieces (the new timbral rows, the recomputed temporal
rows, the mid-end's cached part, ``logits``) and only lays their results out in patch order. The
CPU default's branches: every temporal branch recomputes the rows a hop changes. Eager, its
taggrams equal MusicnnBatch's bit for bit at one stream (tests/audio/test_musicnn_graph.py).

``GraphStream``: one stream's push on the CPU (the window's and ``classify``'s single-stream hop).
Its hops of the steady sizes (15 and 16 frames for 0.25 s) run PushGraph compiled ahead of time
by AOTInductor (``torch._inductor.aoti_compile_and_package``): a shared library per k, built once
per machine, torch version, weights, code and thread count in a low-priority subprocess and kept
in the cache directory (``cache_dir``); loaded in milliseconds (``CompiledPushes``). Until it is
there, or where it cannot be built (no C++ compiler), the same graph runs eagerly, and hops of
other sizes (a stream's first, a jump) always do. Its figures: docs/front-ends.md.

Shapes: G streams, P = 187 patch rows, k new frames, C' = 51 temporal channels."""
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import melspec
from . import BANDS, TEMPORAL, Musicnn, same_padding
from .batch import CPU_ACCUMULATE, EDGE, P, SHIFT_MAX, MusicnnBatch
from .mel import FRAME_HOP


# musicnn frames a 0.25 s hop brings (15.625 on average): the sizes the compiled pushes are for
STEADY_FRAMES = (melspec.HOP // FRAME_HOP, -(-melspec.HOP // FRAME_HOP))
CACHE_NAMES = ("patch", "timbral", "mid", "f0", "f1", "f2")


class PushGraph(nn.Module):
    def __init__(self, fb: MusicnnBatch, k: int):
        super().__init__()
        if fb.accumulate != CPU_ACCUMULATE or not 0 < k <= SHIFT_MAX:
            raise ValueError(f"PushGraph takes the CPU default's branches and 1 <= k <= {SHIFT_MAX} frames")
        self.fb, self.k = fb, k
        dummy = torch.zeros(1, P, BANDS, device=fb.device, dtype=fb.product_dtype)
        for j in range(len(TEMPORAL)):                   # the tap tables, made now: constants of the graph
            fb._recompute(j, dummy, k)

    def forward(self, patch, timbral, mid, f0, f1, f2, new):
        """patch (G, P, 96) normalised, timbral (G, P, 408), mid (G, P, 64), f0..f2 (G, P, C'),
        new (G, k, 96) log-mel frames -> the same caches after the hop, then the taggrams (G, 50)."""
        fb, k = self.fb, self.k
        patch = torch.cat([patch[:, k:], fb.net.normalize(new)], dim=1)       # (G, P, 96)
        # the temporal rows a hop changed, recomputed: P-k-a .. P-1 then 0 .. b-1
        fs, low = [], patch.to(fb.product_dtype)
        for j, f in enumerate((f0, f1, f2)):
            b, a = same_padding(fb.temporal[j][0])
            rows, _ = fb._recompute(j, low, k)
            fs.append(torch.cat([rows[:, k + a:], f[:, b + k:P - a], rows[:, :k + a]], dim=1))
        # timbral: rows P-3-k .. P-4 became interior; mid rows P-6-k .. P-7
        rows = fb._timbral_rows(patch[:, P - k - 2 * EDGE:])                # (G, k, 408)
        timbral = torch.cat([timbral[:, k:P - EDGE], rows, timbral[:, P - EDGE:]], dim=1)
        mid = torch.cat([mid[:, k:P - 2 * EDGE], fb._mid_rows(timbral[:, P - 3 * EDGE - k:P - EDGE]), mid[:, P - 2 * EDGE:]], dim=1)
        taggram = torch.sigmoid(fb.logits(patch, timbral[:, EDGE:P - EDGE], mid[:, 2 * EDGE:P - 2 * EDGE], fs))
        return patch, timbral, mid, *fs, taggram


def state_of(fb: MusicnnBatch, idx) -> list[torch.Tensor]:
    """The caches of slots ``idx`` in patch order (CACHE_NAMES), PushGraph's inputs before the new frames."""
    return [fb._rows(n, np.asarray(idx), 0, P) for n in CACHE_NAMES]


# ----------------------------------------------------------------------------- ahead-of-time compiled

def cache_dir() -> Path:
    """Where the compiled pushes are kept: ``$NYSTREAM_PUSH_CACHE``, else
    ``$XDG_CACHE_HOME/nystream/push`` (``~/.cache/nystream/push``)."""
    if os.environ.get("NYSTREAM_PUSH_CACHE"):
        return Path(os.environ["NYSTREAM_PUSH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nystream" / "push"


def compiling_enabled() -> bool:
    """``NYSTREAM_COMPILED_PUSH=0`` keeps every hop eager (the test suite's default: tests/conftest.py)."""
    return os.environ.get("NYSTREAM_COMPILED_PUSH", "1") != "0"


def package_key(model: str, checksum: str, k: int, threads: int, mode: str = "float32") -> str:
    """A compiled push's name: its model, precision (``mode``), k and the torch threads its
    kernels are written for, and a digest of what else it was built from (this code, torch, the
    CPU's instruction set, the weights), so that any change builds anew; a build removes the
    libraries of the same model, precision, k and threads that it replaces (``stale``)."""
    here = Path(__file__).resolve().parent
    code = hashlib.sha256(b"".join((here / f).read_bytes() for f in ("__init__.py", "branches.py", "batch.py", "graph.py")))
    code.update(f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()} {checksum}".encode())
    return f"push-{model}-{mode}-k{k}-t{threads}-{code.hexdigest()[:16]}"


def stale(out: Path, key: str) -> list[Path]:
    """The files of ``out`` for the same model, k and threads as ``key`` but another digest."""
    prefix = key.rsplit("-", 1)[0] + "-"
    return [p for p in out.glob(prefix + "*") if not p.name.startswith(key) and ".part." not in p.name]


def library_paths(model: str, checksum: str, ks, threads: int, mode: str) -> tuple[dict[int, Path], Path]:
    """The compiled pushes' files in ``cache_dir``: each k's library, and the note a failed
    build leaves (its key with k = 0)."""
    paths = {k: cache_dir() / f"{package_key(model, checksum, k, threads, mode)}.pt2" for k in ks}
    return paths, cache_dir() / f"{package_key(model, checksum, 0, threads, mode)}.failed"


BUSY = 3                                                   # the build's exit status when another process is building
NICE = 10                                                  # the build's priority: below the streams' hops, not starved


def take_lock(lock: Path) -> bool:
    """Create ``lock`` holding this process's pid; False where a live process holds it (a dead
    one's is taken over)."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            pid = int(lock.read_text())
            if pid <= 0:                                   # (0 and below name process groups)
                raise ValueError(pid)
            os.kill(pid, 0)                                # its builder is alive (or another user's)
            return False
        except PermissionError:
            return False
        except (ProcessLookupError, ValueError, FileNotFoundError):   # it died: take the lock over
            lock.unlink(missing_ok=True)
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:                        # another process took it first
                return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def build_packages(model: str, mode: str, ks: list[int], threads: int, out: Path) -> int:
    """Compile PushGraph in precision ``mode`` for each k into ``out``/KEY.pt2 for ``threads``
    torch threads (inductor writes the thread count into its kernels), where it is not there,
    and remove what each replaces: CompiledPushes' subprocess, one compile worker.
    Returns 0, or BUSY where a live process holds the build's lock."""
    from . import build_musicnn
    out.mkdir(parents=True, exist_ok=True)
    lock = out / "build.lock"
    if not take_lock(lock):
        return BUSY
    try:
        torch.set_num_threads(threads)
        one_compile_worker()
        net, checksum = build_musicnn(model)
        net.requires_grad_(False)
        net.precision = mode
        fb = MusicnnBatch(net, 1)
        fb.reset(0)
        for k in ks:
            key = package_key(model, checksum, k, threads, mode)
            path = out / f"{key}.pt2"
            if not path.exists():
                inputs = tuple(t.clone() for t in state_of(fb, [0])) + (torch.zeros(1, k, BANDS),)
                with torch.no_grad():
                    program = torch.export.export(PushGraph(fb, k).eval(), inputs, strict=False)
                partial = out / f"{path.stem}.{os.getpid()}.part.pt2"
                torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
                partial.replace(path)                      # whole or absent: a reader never sees a part
            for old in stale(out, key) + stale(out, package_key(model, checksum, 0, threads, mode)):
                old.unlink(missing_ok=True)                # what this code's libraries replace
    finally:
        lock.unlink(missing_ok=True)
    return 0


class CompiledPushes:
    """One front end's compiled PushGraph for each k of ``ks``, shared by its streams, kept in
    ``cache_dir``: loaded at once where there (torch's C++ package loader, some 30 ms each: no
    import of inductor), else built first by a subprocess at nice 10 (about a minute
    on 2 cores, once per machine: ``nystream prepare`` builds it ahead) that ``get`` looks at,
    at most once a second, and loads from when it ends.
    ``get(k)``: the loaded push (a call on the inputs' list) or None; ``status``: 'building',
    'waiting' (another process builds), 'compiled' or 'eager: REASON' (a failed build is not
    tried again for the same key: delete its .failed file to retry)."""

    LOOK_S = 1.0                                           # between looks at a build

    def __init__(self, model: str, checksum: str, ks: tuple[int, ...], mode: str = "float32"):
        self.model, self.mode, self.ks, self.threads = model, mode, tuple(ks), torch.get_num_threads()
        self.paths, self.failed = library_paths(model, checksum, self.ks, self.threads, mode)
        self.pushes: dict[int, object] = {}
        self.build, self.next_look = None, 0.0
        if self.failed.exists():
            self.status = f"eager: {self.failed.read_text(errors='replace').strip()}"
        elif self._all_there():
            self._load()
        else:
            self._start_build()

    def _all_there(self) -> bool:
        return all(p.exists() for p in self.paths.values())

    def _load(self) -> None:
        try:
            loaders = {k: torch._C._aoti.AOTIModelPackageLoader(str(p), "model", False, 1, -1)
                       for k, p in self.paths.items()}
        except Exception as e:                             # a damaged file: built again next time
            for p in self.paths.values():
                p.unlink(missing_ok=True)
            self.status = f"eager: the compiled push could not be loaded ({type(e).__name__}); removed"
            return
        self.pushes = {k: loader.run for k, loader in loaders.items()}
        self.status = "compiled"

    def _start_build(self) -> None:
        try:
            cache_dir().mkdir(parents=True, exist_ok=True)
            with open(self.failed.with_suffix(".log"), "w") as log:    # the child's own file: no pipe to fill
                self.build = subprocess.Popen(
                    [sys.executable, "-m", "audio.musicnn.graph", self.model, self.mode, ",".join(map(str, self.ks)),
                     str(self.threads), str(cache_dir())],
                    stdout=subprocess.DEVNULL, stderr=log, cwd=Path(__file__).resolve().parents[2])
            self.status = "building"
        except OSError as e:                               # an unwritable cache, no process to spare
            self.status = f"eager: the compiled push could not be built ({e})"

    def get(self, k: int):
        self.look()
        return self.pushes.get(k)

    def look(self) -> None:
        """Where a build runs (or another process's): see whether it ended, at most once a
        second, and load what it built (``status`` then says how it ended)."""
        now = time.monotonic()
        if self.build is None and self.status != "waiting" or now < self.next_look:
            return
        self.next_look = now + self.LOOK_S
        if self.build is None:                             # waiting for another process's build
            if self._all_there():
                self._load()
            elif not (cache_dir() / "build.lock").exists():
                self._start_build()                        # it ended without them: build here
            return
        code = self.build.poll()
        if code is None:
            return
        self.build = None
        if code == BUSY:
            self.status = "waiting"
        elif self._all_there():
            self._load()
        else:
            try:                                           # (a cache emptied meanwhile: no log)
                log = self.failed.with_suffix(".log").read_text(errors="replace")
            except OSError:
                log = ""
            lines = [line.strip() for line in log.splitlines() if line.strip()]
            reason = f"the compiled push could not be built ({lines[-1][:200] if lines else f'exit status {code}'})"
            if code != -9:                                 # killed (``close``): tried again next time
                try:
                    self.failed.write_text(reason + "\n")
                except OSError:
                    pass
            self.status = f"eager: {reason}"

    WORDS = {"compiled": "compiled (AOTInductor)",
             "building": "eager while its compiled form builds in the background (about a minute, once)",
             "waiting": "eager while another process builds its compiled form"}

    def words(self) -> str:
        """``status`` as a user reads it, after a look at the build."""
        self.look()
        return self.WORDS.get(self.status, self.status)

    def wait(self, timeout: float = 900.0) -> str:
        """Until the build (or another process's) is over, at most ``timeout`` s; the status."""
        deadline = time.monotonic() + timeout
        while self.status in ("building", "waiting") and time.monotonic() < deadline:
            time.sleep(0.2)
            self.look()
        return self.status

    def close(self) -> None:
        """Stop a build still running (the next start builds again)."""
        if self.build is not None and self.build.poll() is None:
            self.build.kill()
            self.build.wait()


class GraphStream:
    """``push(frames (k, 96)) -> (50,)`` taggram of the newest 187 frames, ``last_macs`` its
    multiply-accumulates, ``reset()``; the caches (CACHE_NAMES) in patch order in ``state``.
    A hop of 1 <= k <= SHIFT_MAX frames runs PushGraph, compiled where ``pushes`` has it for k
    (CompiledPushes), else eager; a longer one (a jump) and the multiply-accumulates come from
    a MusicnnBatch of one slot, whose arithmetic the graph is. ``like``: another GraphStream of
    the same network whose batch of one slot (the silence's caches, the tap tables, jumps),
    eager graphs and counts this one shares, so that a new stream's first hops cost no set-up;
    streams that share them push one at a time (as one engine's do)."""

    def __init__(self, net: Musicnn, pushes: CompiledPushes | None = None, like: "GraphStream | None" = None):
        if like is not None and like.batch.net is not net:
            raise ValueError("GraphStream(like=...) must run the same network")
        self.batch = like.batch if like else MusicnnBatch(net, 1, accumulate=CPU_ACCUMULATE)
        self.graphs: dict[int, object] = like.graphs if like else {}
        self.macs_of: dict[int, int] = like.macs_of if like else {}
        self.pushes = pushes
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """A stream preceded by silence (MusicnnBatch.template)."""
        self.batch.reset(0)
        self.state = [t.clone() for t in state_of(self.batch, [0])]
        self.last = self.batch.state["last"][0].clone()
        self.last_macs = 0

    def _macs(self, k: int) -> int:
        """The multiply-accumulates of a shift by k: MusicnnBatch's count (the same every hop),
        from a hop of silence in the batch's slot (which only a jump reads, after refilling it)."""
        if k not in self.macs_of:
            self.batch.reset(0)
            self.batch.push([0], [np.zeros((k, BANDS), np.float32)])
            self.macs_of[k] = int(self.batch.macs[0])
        return self.macs_of[k]

    @torch.no_grad()
    def push(self, frames: np.ndarray | torch.Tensor) -> torch.Tensor:
        """frames: (k, 96) new log-mel frames (k may be 0) -> (50,) taggram of the patch."""
        new = torch.as_tensor(np.asarray(frames, dtype=np.float32)).reshape(-1, BANDS)
        k = min(len(new), P)
        if k == 0:
            self.last_macs = 0
            return self.last
        if k > SHIFT_MAX:                                  # a jump: the batch recomputes every cache
            self.batch.start[0] = 0
            self.batch.state["patch"][0] = self.state[0][0]
            self.last = self.batch.push([0], [new[-k:].numpy()])[0]
            self.state = [t.clone() for t in state_of(self.batch, [0])]
            self.last_macs = int(self.batch.macs[0])
            return self.last
        run = self.pushes.get(k) if self.pushes is not None else None
        if run is None:                                    # the graph eager, called as the compiled one is
            if k not in self.graphs:
                graph = PushGraph(self.batch, k).eval()
                self.graphs[k] = lambda inputs, graph=graph: graph(*inputs)
            run = self.graphs[k]
        *self.state, taggram = run([*self.state, new[None]])
        self.last, self.last_macs = taggram[0], self._macs(k)
        return self.last


def one_compile_worker() -> None:
    """inductor compiles in this process, with no pool of compile workers beside it."""
    import torch._inductor.config as inductor
    inductor.compile_threads = 1


def compiler_problem() -> str | None:
    """Why inductor cannot compile here (no C++ compiler), or None: its own search, made before
    any export or codegen."""
    from torch._inductor import cpp_builder, exc
    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return "no working C++ compiler: inductor needs g++ (or $CXX)"
    return None


def prepare(threads: int, model: str = "MSD_musicnn", mode: str = "float32") -> str:
    """The compiled pushes of ``model`` in precision ``mode`` for ``threads`` torch threads in
    ``cache_dir``, built here at this process's priority where missing (``nystream prepare``, the
    tests); what happened, in words."""
    from . import load_weights
    paths, failed = library_paths(model, load_weights(model)[1], STEADY_FRAMES, threads, mode)
    if all(p.exists() for p in paths.values()):
        return "ready (cached)"
    problem = compiler_problem()
    if problem:
        return f"not built ({problem}); the push runs eagerly"
    failed.unlink(missing_ok=True)                         # asked for: tried again
    t0 = time.perf_counter()
    while build_packages(model, mode, list(STEADY_FRAMES), threads, cache_dir()) == BUSY:
        time.sleep(1.0)                                    # another process builds: then look again
    return f"built in {time.perf_counter() - t0:.0f} s"


if __name__ == "__main__":                                 # CompiledPushes' build: MODEL PRECISION K[,K...] THREADS DIR
    os.nice(NICE)
    problem = compiler_problem()
    if problem:
        sys.exit(problem)                                  # the log's last line: the reason
    model, mode, ks, threads, out = sys.argv[1:6]
    t0 = time.perf_counter()
    code = build_packages(model, mode, [int(k) for k in ks.split(",")], int(threads), Path(out))
    print(f"{'busy' if code else 'built'} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sys.exit(code)
