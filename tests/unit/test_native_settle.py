"""A release returns torch's cached blocks, and pays for a full garbage collection (a quarter of a
second with torch and transformers loaded) only when bytes are still allocated past the baseline,
i.e. when a reference cycle holds tensors: a clean release, on the ready path, never does."""

from __future__ import annotations

import torch

from bootstrap.backends.native import backend as native
from bootstrap.backends.native.backend import NativeBackend
from bootstrap.devices import FakeDevice, GiB
from bootstrap.pipeline.undo import Undo


class CountingDevice(FakeDevice):
    def __init__(self) -> None:
        super().__init__(total=8 * GiB)
        self.emptied = 0

    def empty_cache(self) -> None:
        self.emptied += 1


def collections(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(native.gc, "collect", lambda *a: calls.append(1) or 0)
    return calls


def test_a_clean_release_does_not_collect(monkeypatch):
    device = CountingDevice()
    backend, undo, calls = NativeBackend(device, torch.device("cpu")), Undo(), collections(monkeypatch)
    undo.push(backend._settler())  # baseline: nothing allocated
    handle = device.allocate(GiB, "pool")
    undo.push(lambda: device.free(handle))
    undo.run()
    assert calls == [] and device.emptied == 1


def test_bytes_still_held_after_a_release_trigger_one_collection(monkeypatch):
    device = CountingDevice()
    backend, undo, calls = NativeBackend(device, torch.device("cpu")), Undo(), collections(monkeypatch)
    undo.push(backend._settler())
    device.allocate(GiB, "held by a cycle")  # never freed by the undo entries
    undo.run()
    assert calls == [1] and device.emptied == 2  # the cache returned first, and again after the collection


def test_bytes_the_returned_cache_frees_do_not_trigger_a_collection(monkeypatch):
    """As a capture's cuBLAS workspace: allocated past the baseline until the cache is returned
    (``release_workspaces`` then ``empty_cache``); it made every swap's release pay a collection."""

    class WorkspaceDevice(CountingDevice):
        def empty_cache(self) -> None:
            super().empty_cache()
            if workspace:
                self.free(workspace.pop())

    device = WorkspaceDevice()
    backend, undo, calls = NativeBackend(device, torch.device("cpu")), Undo(), collections(monkeypatch)
    undo.push(backend._settler())
    workspace = [device.allocate(32 << 20, "workspace")]
    undo.run()
    assert calls == [] and device.emptied == 1
