"""``is_oom`` decides which failures are retried with a smaller workload: it must know torch's
own out-of-memory errors on a machine without a GPU, built from the real torch classes."""

from __future__ import annotations

import pytest
import torch

from bootstrap.devices import DeviceOutOfMemory, is_oom


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        torch.cuda.OutOfMemoryError(),  # known by its class alone, whatever the message says
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"),
        DeviceOutOfMemory("out of memory allocating 1 byte"),
        MemoryError(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_out_of_memory_errors_are_recognised(exc):
    assert is_oom(exc)


def test_a_real_cpu_allocation_failure_is_recognised():
    with pytest.raises(RuntimeError) as info:  # 4 EiB: refused by the allocator at once
        torch.empty(1 << 62, dtype=torch.uint8)
    assert is_oom(info.value), str(info.value)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
        ValueError("bad value"),
        OSError("No space left on device"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_other_errors_are_not(exc):
    assert not is_oom(exc)
