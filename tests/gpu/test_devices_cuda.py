"""CudaDevice reads what torch.cuda reports: allocations move allocated, peak and free."""

from __future__ import annotations

import pytest
import torch

from bootstrap.devices import CudaDevice, Device, is_oom

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MiB = 1024**2


def test_cuda_device_follows_allocations():
    device = CudaDevice(0)
    assert isinstance(device, Device) and "cuda:0" in device.name
    device.empty_cache()
    device.reset_peak()
    before_alloc, before_free = device.allocated_bytes(), device.free_bytes()
    block = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    device.synchronize()
    assert device.allocated_bytes() - before_alloc == 256 * MiB
    assert before_free - device.free_bytes() >= 256 * MiB
    del block
    device.empty_cache()
    assert device.allocated_bytes() == before_alloc
    assert device.peak_bytes() >= before_alloc + 256 * MiB
    device.reset_peak()
    assert device.peak_bytes() == before_alloc
    assert 0 < device.free_bytes() <= device.total_bytes()


def test_a_real_cuda_oom_is_recognised():
    device = CudaDevice(0)
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(device.total_bytes() * 2, dtype=torch.uint8, device="cuda")
    assert is_oom(info.value)
