"""Triton's once-per-process start, run beside ``import torch`` instead of after it.

The first Triton kernel a process launches, compiled or found in Triton's on-disk cache, first
pays for Triton itself: its import, its ``gluon`` frontend's import, and ``triton_key``, a hash
of Triton's sources and of its large library that keys every cache entry: seconds beside the
weight read (benchmarks/README.md, "Figures without a saved result"). None of it needs
torch (Triton imports no torch module), so a command that will launch kernels on CUDA calls
``begin_for`` as soon as it knows that (the kernels' compile-ahead calls ``begin`` too), and it
runs in a thread while the main thread imports torch; ``wait`` joins it before the engine's own
modules import Triton, so the two threads never import the same module. A failure here only
means the first kernel pays for it, as it would without this; it is logged, never raised.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from importlib.util import find_spec

log = logging.getLogger(__name__)
_lock = threading.Lock()
_thread: threading.Thread | None = None


def begin_for(device: str, backend: str, tensor_parallel_size: int) -> bool:
    """``begin`` for a single-process native run on CUDA (a command's choice, from its config);
    True when Triton's start was begun (now or before)."""
    return device.startswith("cuda") and backend == "native" and tensor_parallel_size == 1 and begin()


def begin() -> bool:
    """Start Triton's start in a thread, once per process, when Triton is installed; True when
    it was started (now or before)."""
    global _thread
    with _lock:
        if _thread is None:
            if find_spec("triton") is None:
                return False
            _thread = threading.Thread(target=_start, name="bootstrap-triton-start", daemon=True)
            _thread.start()
    return True


def wait() -> None:
    """Join the thread ``begin`` started (at once when none was)."""
    with _lock:
        thread = _thread
    if thread is not None:
        thread.join()


def _start() -> None:
    try:
        import triton

        try:
            from triton.runtime.cache import triton_key
        except ImportError:  # Triton before 3.4 keeps it in the compiler
            from triton.compiler.compiler import triton_key
        triton_key()
        with contextlib.suppress(ImportError):  # Triton 3.5 and later import it at the first compile
            import triton.experimental.gluon  # noqa: F401
    except Exception as exc:
        log.info("starting Triton ahead failed (%s: %s); the first kernel starts it", type(exc).__name__, exc)
