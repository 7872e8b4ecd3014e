"""Where numba caches the fused kernels: one directory per user, found by the source file's path
inside this project, not by where the project lies.

numba's own cache sits beside the source (``__pycache__``), so a fresh copy of the code, such
as a Ray Serve replica's or a Ray worker's ``working_dir``, would lie at a new path with no
cache and compile every kernel again, tens of seconds of a replica's warm-up. Here every
copy of the same source shares one cache: ``$NUMBA_CACHE_DIR/nystream`` when that is set, else
``$XDG_CACHE_HOME/nystream/numba`` (``~/.cache/nystream/numba``). numba still checks each entry
against its source file's stamp (here with the state definitions' too, ``STATE_FILES``) and the
machine's CPU, so a changed file or another CPU compiles anew. Where that directory cannot be
written, numba's own places are used.

numba's internals (its cache locators, its CPU target, a dispatcher's typing and compiled entry
points) are used here and nowhere else (tests/app/test_private_apis.py says which a numba
upgrade removed).
"""
from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent                # models/fused/: the kernels' files
ROOT = HERE.parents[1]                                 # the project (or site-packages, installed)
# the NamedTuples the kernels read by name (compiled to positions): a change there compiles anew
STATE_FILES = tuple(ROOT / "models" / "stream" / name for name in ("continual.py", "nystrom.py"))


def cache_root() -> Path:
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"]) / "nystream"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nystream" / "numba"


def share() -> None:
    """Make numba look here first for the fused kernels (idempotent; with a numba that lacks
    these cache internals, nothing changes)."""
    try:
        from numba.core import caching
    except ImportError:                                # pragma: no cover - numba ships with librosa
        return
    base = getattr(caching, "_SourceFileBackedLocatorMixin", None)
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    if base is None or impl is None or any(c.__name__ == "ProjectCacheLocator" for c in impl._locator_classes):
        return

    class ProjectCacheLocator(base, caching._CacheLocator):
        """numba's cache locator for a file of models/fused/: the cache root plus the file's
        directory inside the project."""

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(cache_root() / Path(py_file).resolve().parent.relative_to(ROOT))

        def get_cache_path(self):
            return self._cache_path

        def get_source_stamp(self):
            """The kernel file's stamp (as numba's) and the state definitions' (STATE_FILES)."""
            return tuple((st.st_mtime, st.st_size) for st in (os.stat(f) for f in (self._py_file, *STATE_FILES)))

        @classmethod
        def from_function(cls, py_func, py_file):
            try:
                Path(py_file).resolve().relative_to(HERE)
            except (ValueError, OSError):
                return None                            # not the kernels' (librosa's...): numba's own places
            return super().from_function(py_func, py_file)

    impl._locator_classes.insert(0, ProjectCacheLocator)


def set_up_numba() -> None:
    """numba's CPU target set up in this process (~0.4 s the first time, then nothing; what a
    first call would otherwise do, holding the GIL for 0.1 s at a time)."""
    from numba.core import registry
    registry.cpu_target.target_context.refresh()
    registry.cpu_target.typing_context.refresh()



class Calls:
    """Kernels called through their compiled entry points, each typed at its first call here,
    without numba's typing of every argument at every call (a few microseconds for a step's
    named state and landmarks, as much as the step's own arithmetic at n = 120). Every call of a
    kernel through one ``Calls`` must pass arguments of the same types: dtypes, ranks and
    layouts (the compiled code reads C-contiguous arrays as such)."""

    def __init__(self):
        self.entries: dict = {}

    def __call__(self, kernel, *args):
        entry = self.entries.get(kernel)
        if entry is None:              # loaded from the cache, or compiled, where this process lacks it
            entry = self.entries[kernel] = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
        return entry(*args)
