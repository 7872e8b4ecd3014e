"""The fused kernels' numba cache (models/fused/numba_cache.py) is shared by every copy of the
code: a copy at another path (as a Ray Serve replica's or Ray worker's working_dir) loads what
the checkout compiled, and a copy whose source changed, or the state the kernels read by name
(models/stream/continual.py, nystrom.py), compiles anew. Each run is a fresh
process with its own cache directory (XDG_CACHE_HOME); numba's own counters say whether a
kernel came from the cache."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models.fused import available

pytestmark = pytest.mark.skipif(not available(), reason="numba not installed")
ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json
import numpy as np
from models.fused import kernels as K
w, b, x, out = np.ones((8, 4), np.float32), np.zeros(8, np.float32), np.ones(4, np.float32), np.zeros(8, np.float32)
K.linear(w, b, x, out)
print(json.dumps({"file": K.__file__, "hits": sum(K.linear.stats.cache_hits.values()),
                  "misses": sum(K.linear.stats.cache_misses.values()), "path": K.linear._cache._cache_path,
                  "out": out.tolist()}))
"""


def probe(root: Path, cache: Path) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(root)}
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_copy_of_the_code_elsewhere_loads_the_kernels_the_checkout_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = probe(ROOT, cache)
    assert first["misses"] == 1 and first["hits"] == 0                       # compiled, and stored ...
    assert Path(first["path"]) == cache / "nystream" / "numba" / "models" / "fused"
    copy = tmp_path / "replica"
    shutil.copytree(ROOT / "models", copy / "models", ignore=shutil.ignore_patterns("__pycache__"))
    again = probe(copy, cache)
    assert again["file"].startswith(str(copy))                                # ... the copy's own source ...
    assert again["misses"] == 0 and again["hits"] == 1 and again["out"] == first["out"] == [4.0] * 8   # ... from the cache
    with open(copy / "models" / "fused" / "kernels.py", "a") as f:
        f.write("\n# changed\n")
    changed = probe(copy, cache)
    assert changed["misses"] == 1 and changed["hits"] == 0                   # a changed source compiles anew
    assert probe(copy, cache)["hits"] == 1
    with open(copy / "models" / "stream" / "nystrom.py", "a") as f:          # the state the kernels read by name
        f.write("\n# changed\n")
    changed = probe(copy, cache)
    assert changed["misses"] == 1 and changed["hits"] == 0                   # ... and so does a changed state
