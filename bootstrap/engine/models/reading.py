"""Weights read into a built model in a thread of their own, while the caller goes on.

The model's storage is allocated and every header checked before the read starts
(``weights.plan_weights``), so what needs only the parameters' addresses (a KV pool beside them,
a CUDA graph capture, which runs ``thread_local`` and leaves other threads' copies alone) can run
meanwhile; what needs their values ``wait``s. A read that failed is read again once, in the
waiting thread (a transient I/O error); ``stop`` ends it early (a release) and waits for it.
"""

from __future__ import annotations

import threading
import time

import torch

from bootstrap.devices import trim_host_heap
from bootstrap.engine.models.compile_ahead import compiling_ahead
from bootstrap.engine.models.weights import WeightReads


class BackgroundRead:
    def __init__(self, reads: WeightReads, model: torch.nn.Module) -> None:
        self._reads: WeightReads | None = reads
        self._model: torch.nn.Module | None = model
        self.nbytes = reads.nbytes
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.began = time.perf_counter()
        self.seconds: float | None = None  # the read's duration (``compile_wait_s`` in it), once it ended
        self.compile_wait_s: float | None = None  # after the bytes, waiting for the kernels' compile
        self._thread = threading.Thread(target=self._run, name="bootstrap-weights-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with compiling_ahead(self._model):  # Triton's first compile of the kernels, meanwhile
                self._reads.read(stop=self._stop)
                read = time.perf_counter()
            self.compile_wait_s = time.perf_counter() - read
            self._forget()
        except BaseException as exc:  # handed to the waiter
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - self.began
            trim_host_heap()  # the read's staging buffers, freed by its threads

    def _forget(self) -> None:
        """Drop the plan and the model: the plan's destinations are views of every parameter, and
        would keep the device storage alive after an offload or a release moved it away."""
        self._reads = self._model = None

    def wait(self) -> float:
        """Block until every byte is in; the seconds waited. Raises what a second read raised."""
        began = time.perf_counter()
        self._thread.join()
        if self._stop.is_set():
            raise RuntimeError("the weights' read was stopped: the model was released")
        if self._error is not None:
            self._reads.read()  # once more, here: a second error is the stage's (and its retry reads again)
            self._error = None
            self._forget()
        return time.perf_counter() - began

    def stop(self) -> None:
        """End the read after the pieces in flight and wait for it (idempotent)."""
        self._stop.set()
        self._thread.join()
        self._forget()
