"""The private torch and numba APIs the app relies on: each is used in one module only, and each
still exists in the installed torch and numba (an upgrade that removes one fails here, naming
the module to update, rather than in a build or a first hop)."""
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (the private name as the source writes it, the attribute to look up, the one module that uses it)
PRIVATE = [
    ("torch._inductor", "torch._inductor.aoti_compile_and_package", "audio/musicnn/graph.py"),
    ("torch._inductor", "torch._inductor.config.compile_threads", "audio/musicnn/graph.py"),
    ("torch._inductor", "torch._inductor.cpp_builder.get_cpp_compiler", "audio/musicnn/graph.py"),
    ("torch._inductor", "torch._inductor.exc.InvalidCxxCompiler", "audio/musicnn/graph.py"),
    ("torch._C._aoti", "torch._C._aoti.AOTIModelPackageLoader", "audio/musicnn/graph.py"),
    ("_is_avx512_bf16_supported", "torch.cpu._is_avx512_bf16_supported", "audio/musicnn/__init__.py"),
    ("_is_amx_tile_supported", "torch.cpu._is_amx_tile_supported", "audio/musicnn/__init__.py"),
    ("torch._dynamo", "torch._dynamo.reset", "app/offline/onnx_export.py"),
    ("numba.core", "numba.core.caching._CacheLocator", "models/fused/numba_cache.py"),
    ("numba.core", "numba.core.caching._SourceFileBackedLocatorMixin", "models/fused/numba_cache.py"),
    ("numba.core", "numba.core.registry.cpu_target", "models/fused/numba_cache.py"),
    # a dispatcher's typing and compiled entry points (numba_cache.Calls)
    ("typeof_pyval", "numba.core.dispatcher.Dispatcher.typeof_pyval", "models/fused/numba_cache.py"),
    ("typeof_pyval", "numba.core.dispatcher.Dispatcher.compile", "models/fused/numba_cache.py"),
]


def resolve(dotted: str):
    """The object at ``dotted``, importing its modules on the way; AttributeError if gone."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=1):
        if not hasattr(obj, name):
            try:
                importlib.import_module(".".join(parts[:i + 1]))
            except ImportError:
                pass
        obj = getattr(obj, name)
    return obj


@pytest.mark.parametrize("token,dotted,where", PRIVATE, ids=[p[1] for p in PRIVATE])
def test_each_private_api_still_exists(token, dotted, where):
    library = importlib.import_module(dotted.split(".")[0])
    try:
        resolve(dotted)
    except AttributeError:
        pytest.fail(f"{dotted} is gone in {library.__name__} {library.__version__}: {where} needs updating")


def test_each_private_api_is_used_in_one_module():
    tokens = {token for token, _, _ in PRIVATE}
    used: dict[str, set[str]] = {t: set() for t in tokens}
    for package in ("app", "audio", "models"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            for t in tokens:
                if re.search(re.escape(t) + r"\b", text):
                    used[t].add(str(path.relative_to(ROOT)))
    want = {token: {where for tk, _, where in PRIVATE if tk == token} for token in tokens}
    assert used == want
