"""Ray for the offline jobs: start a local instance or join a cluster, and check it can run us.

Imported only with ``--ray``. ``--ray`` alone starts a local Ray instance on this machine's cores
and shuts it down at the end; ``--ray auto`` joins the cluster that `ray start` set up on this
machine, ``--ray ray://HOST:PORT`` a remote one (Ray Client). Workers import this checkout's
code (``PYTHONPATH`` in the job's runtime environment), so every node must hold the project at the
same path with its dependencies installed (`make setup`); a cluster that cannot import it is
refused with one line before any work starts.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LOCAL = "local"                      # what a bare --ray means


class RayClusterError(RuntimeError):
    """Ray cannot be started or reached, or its workers cannot run Nystream's code."""


PROJECT_MODULES = ("app.offline.extract", "audio.frontends", "models.transformer")


def probe(modules) -> str:
    """(on a worker) Import ``modules``; the checkout the first one comes from."""
    import importlib
    found = [importlib.import_module(m) for m in modules]
    return str(Path(found[0].__file__).resolve().parents[2])


@contextlib.contextmanager
def ray_session(address: str = LOCAL, num_cpus: int | None = None, modules=PROJECT_MODULES):
    """Yield the ``ray`` module connected to ``address``, its workers checked to import
    ``modules``; a Ray connection made here is shut down on exit (one the caller holds, as a
    test does, is used as it is). Raises RayClusterError (one line) when Ray is missing,
    unreachable or cannot run the project on its workers."""
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise RayClusterError(f"--ray needs Ray: pip install 'ray[data,tune]' ({e})") from e
    import logging
    logging.getLogger("ray.data").setLevel(logging.ERROR)         # no per-dataset INFO lines
    ray.data.DataContext.get_current().enable_progress_bars = False   # ours has the ETA
    if ray.is_initialized():
        check_workers(ray, "the connected Ray", modules)
        yield ray
        return
    # Workers start their OpenMP runtime as this process did (unset here: 2 threads): on some CPUs
    # MKL and oneDNN pick other kernels in a process started with OMP_NUM_THREADS=1, and tokens
    # computed on one torch thread would then differ from this process's in the last bits.
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}}
    kw = dict(runtime_env=env, log_to_driver=False, include_dashboard=False,
              configure_logging=False)
    try:
        reachable(address)
        if address == LOCAL:        # a new instance, even where `ray start` runs one
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count(),
                     object_store_memory=256 * 2**20, **kw)
        else:
            ray.init(address=address, **kw)
    except Exception as e:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError, ...
        raise RayClusterError(f"cannot {'start Ray' if address == LOCAL else f'reach the Ray cluster at {address!r}'}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")) from e
    try:
        check_workers(ray, f"the Ray cluster at {address!r}", modules)
        yield ray
    finally:
        ray.shutdown()


def check_workers(ray, what: str, modules) -> None:
    """Raise RayClusterError unless a worker imports ``modules`` from this checkout."""
    try:
        where = ray.get(ray.remote(num_cpus=0)(probe).remote(list(modules)), timeout=120)
    except Exception as e:  # noqa: BLE001 - RayTaskError wrapping ImportError, GetTimeoutError
        cause = getattr(e, "cause", None) or e
        raise RayClusterError(
            f"{what} cannot run Nystream's code ({type(cause).__name__}: "
            f"{str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}); every node needs "
            f"this project at {ROOT} with its dependencies (make setup)") from e
    if modules == PROJECT_MODULES and Path(where) != ROOT:
        raise RayClusterError(f"{what}'s workers import Nystream from {where}, not from {ROOT}; "
                              f"start every node from this checkout")


def reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError quickly if ``address`` (HOST:PORT or ray://HOST:PORT) does not
    answer (ray.init would retry for minutes); 'local' and 'auto' are Ray's to resolve."""
    import socket
    if address in (LOCAL, "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, ray://HOST:PORT or auto, got {address!r}")
    with socket.create_connection((host, int(port)), timeout=timeout_s):
        pass
