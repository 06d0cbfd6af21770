"""The memory port: what the stages need to know about a device, and nothing more.

``CudaDevice`` reads torch.cuda, ``CpuDevice`` reads system memory and this process's resident
set, ``FakeDevice`` simulates a GPU for stage tests and the dry-run planner: a capacity,
allocations by tag, injectable out-of-memory errors and leak accounting.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

GiB = 1024**3
MiB = 1024**2


class DeviceOutOfMemory(RuntimeError):
    """An allocation did not fit. Raised by ``FakeDevice``; ``is_oom`` also knows torch's."""


def is_oom(exc: BaseException) -> bool:
    """True for any out-of-memory error: ours, torch's (CUDA or CPU), or a MemoryError."""
    if isinstance(exc, DeviceOutOfMemory | MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch
        return True
    text = str(exc).lower()  # the CPU allocator says "can't allocate memory"
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


@runtime_checkable
class Device(Protocol):
    name: str
    kind: str  # "cuda" | "cpu" | "fake"

    def total_bytes(self) -> int: ...
    def free_bytes(self) -> int: ...
    def allocated_bytes(self) -> int: ...
    def peak_bytes(self) -> int: ...
    def reset_peak(self) -> None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self) -> None: ...


class CudaDevice:
    kind = "cuda"

    def __init__(self, index: int = 0) -> None:
        import torch

        self._cuda = torch.cuda
        self.index = index
        self.name = f"{torch.cuda.get_device_name(index)} (cuda:{index})"

    def total_bytes(self) -> int:
        return self._cuda.mem_get_info(self.index)[1]

    def free_bytes(self) -> int:
        return self._cuda.mem_get_info(self.index)[0]

    def allocated_bytes(self) -> int:
        return self._cuda.memory_allocated(self.index)

    def peak_bytes(self) -> int:
        return self._cuda.max_memory_allocated(self.index)

    def reset_peak(self) -> None:
        self._cuda.reset_peak_memory_stats(self.index)

    def empty_cache(self) -> None:
        """Return torch's cached blocks to the device. cuBLAS workspaces stay: a captured CUDA
        graph replays its GEMMs into the workspace it was captured with, so freeing one under a
        live graph corrupts memory (``engine.step.graphs.release_workspaces`` frees them once no
        graph is left)."""
        self._cuda.empty_cache()

    def synchronize(self) -> None:
        self._cuda.synchronize(self.index)


class CpuDevice:
    """System memory. Allocated = this process's resident set; peak = its high-water mark.

    On Linux the high-water mark is reset by writing 5 to /proc/self/clear_refs; elsewhere the
    peak is the lifetime peak, which over-estimates and so stays safe.
    """

    kind = "cpu"
    name = "cpu"

    def total_bytes(self) -> int:
        import psutil

        return psutil.virtual_memory().total

    def free_bytes(self) -> int:
        import psutil

        return psutil.virtual_memory().available

    def allocated_bytes(self) -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def peak_bytes(self) -> int:
        status = Path("/proc/self/status")
        if status.exists():
            match = re.search(r"VmHWM:\s+(\d+) kB", status.read_text())
            if match:
                return int(match.group(1)) * 1024
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def reset_peak(self) -> None:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")

    def empty_cache(self) -> None:
        """Nothing to return: torch's CPU allocator keeps no cache (a large tensor's pages go back
        to the system when it is freed)."""

    def synchronize(self) -> None:
        pass


@dataclass
class _Fault:
    tag_prefix: str
    remaining: int


@dataclass
class FakeDevice:
    """A simulated GPU: ``total`` bytes, of which ``non_torch`` are taken outside the allocator.

    ``allocate`` returns a handle and raises ``DeviceOutOfMemory`` when the bytes do not fit or
    when an injected fault matches the allocation's tag. ``live()`` is the leak account.
    """

    total: int
    name: str = "fake-gpu"
    non_torch: int = 0
    kind: str = "fake"
    _allocs: dict[int, tuple[int, str]] = field(default_factory=dict, repr=False)
    _peak: int = 0
    _faults: list[_Fault] = field(default_factory=list, repr=False)
    _ids: itertools.count = field(default_factory=itertools.count, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)  # stages run on threads

    def total_bytes(self) -> int:
        return self.total

    def free_bytes(self) -> int:
        return self.total - self.non_torch - self.allocated_bytes()

    def allocated_bytes(self) -> int:
        with self._lock:
            return sum(n for n, _ in self._allocs.values())

    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self.allocated_bytes()

    def empty_cache(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def inject_oom(self, tag_prefix: str, times: int = 1) -> None:
        """Make the next ``times`` allocations whose tag starts with ``tag_prefix`` fail."""
        self._faults.append(_Fault(tag_prefix, times))

    def allocate(self, nbytes: int, tag: str) -> int:
        if nbytes < 0:
            raise ValueError(f"allocation size must be >= 0, got {nbytes} for {tag!r}")
        with self._lock:
            self._raise_injected(nbytes, tag)
            if nbytes > self.free_bytes():
                raise DeviceOutOfMemory(
                    f"out of memory allocating {nbytes / GiB:.2f} GiB for {tag!r} on {self.name}: "
                    f"{self.free_bytes() / GiB:.2f} GiB free of {self.total / GiB:.2f} GiB"
                )
            handle = next(self._ids)
            self._allocs[handle] = (nbytes, tag)
            self._peak = max(self._peak, self.allocated_bytes())
            return handle

    def free(self, handle: int) -> None:
        with self._lock:
            if self._allocs.pop(handle, None) is None:
                raise KeyError(f"double free or unknown allocation handle {handle}")

    def live(self) -> dict[str, int]:
        """Bytes still allocated, by tag: the leak account."""
        out: dict[str, int] = {}
        with self._lock:
            for n, tag in self._allocs.values():
                out[tag] = out.get(tag, 0) + n
        return out

    def _raise_injected(self, nbytes: int, tag: str) -> None:
        for fault in self._faults:
            if fault.remaining > 0 and tag.startswith(fault.tag_prefix):
                fault.remaining -= 1
                raise DeviceOutOfMemory(
                    f"out of memory (injected fault) allocating {nbytes / GiB:.2f} GiB for {tag!r} on {self.name}"
                )


def trim_host_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere): large host buffers freed by reader threads (a load's page-locked staging) stay
    in their arenas otherwise, and a server that loads again and again grows in resident set."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
