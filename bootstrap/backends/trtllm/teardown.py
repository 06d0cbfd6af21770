"""Rollback, in the order the reference's teardown list gives (§2, stages 2, 3 and 6):

1. ``py_executor.shutdown()`` if its worker was started (``shutdown`` waits on an event only the
   worker loop sets: on a never-started executor it would block forever, so that one is dropped);
2. ``teardown_managers(resources)`` (KV and draft managers; a second shutdown after the
   executor's is what TRT itself does);
3. pop the non-KV resources (spec resource manager, sequence slots, PEFT cache);
4. ``engine._release_cuda_graphs()`` when CUDA graphs are on, then ``attn_metadata = None``;
5. ``gc.collect()`` and ``empty_cache``.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bootstrap.backends.trtllm.checked_api import TrtllmApi
from bootstrap.backends.trtllm.handles import Build, Engines
from bootstrap.devices import Device

EXTRA_RESOURCES = ("SEQ_SLOT_MANAGER", "SPEC_RESOURCE_MANAGER", "PEFT_CACHE_MANAGER")


def stop_executor(api: TrtllmApi, build: Build) -> None:
    """Step 1: shut a started executor down once; drop one that never started."""
    if build.executor is not None and build.started and not build.shut_down:
        build.shut_down = True
        api.invoke(build.executor, "PyExecutor.shutdown")
    build.executor = None


def release_build(api: TrtllmApi, device: Device, engines: Engines, build: Build) -> None:
    """Steps 1-5 for one probe or final build; safe to run twice and on a half-made build."""
    stop_executor(api, build)
    kv_key = api.constant("ResourceManagerType.KV_CACHE_MANAGER")
    if build.creators and kv_key in build.resources:
        build.resources.setdefault(api.constant("ResourceManagerType.DRAFT_KV_CACHE_MANAGER"), None)
        api.invoke(build.creators[0], "KvCacheCreator.teardown_managers", resources=build.resources)
    for name in EXTRA_RESOURCES:
        build.resources.pop(api.constant(f"ResourceManagerType.{name}"), None)
    build.resources.clear()
    build.creators.clear()
    release_cuda_graphs(api, engines)
    collect(device)


def release_cuda_graphs(api: TrtllmApi, engines: Engines) -> None:
    """Step 4: free what an executor's warmup captured, so the next warmup starts clean."""
    graphs_on = engines.args is not None and api.get(engines.args, "TorchLlmArgs.cuda_graph_config") is not None
    for engine in (engines.engine, engines.draft):
        if engine is None or api.get(engine, "PyTorchModelEngine.attn_metadata") is None:
            continue
        if graphs_on:
            api.invoke(engine, "PyTorchModelEngine._release_cuda_graphs")
        api.put(engine, "PyTorchModelEngine.attn_metadata", None)


def release_engines(device: Device, engines: Engines) -> None:
    """``load_model``'s rollback: drop the engines and sampler; torch frees them on collection."""
    engines.release()
    collect(device)


def collect(device: Device) -> None:
    """Step 5."""
    gc.collect()
    device.empty_cache()


@contextmanager
def frames_dropped_on_error() -> Iterator[None]:
    """Around each stage's work: a TensorRT-LLM call that fails half-way keeps what it allocated
    in the locals of its (finished) frames, and the exception's traceback keeps those frames for
    as long as anyone holds the error (``StageFailed.cause``): a first KV manager when the
    second runs out of memory, or a creator holding the engine. Clearing the frames lets the
    rollback's ``gc.collect()`` free it."""
    try:
        yield
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise


def kv_allocated_bytes(api: TrtllmApi, resources: dict[Any, Any]) -> int:
    """Target + draft KV bytes, read as ``configure_kv_cache_capacity`` reads them."""
    total = 0
    for name in ("KV_CACHE_MANAGER", "DRAFT_KV_CACHE_MANAGER"):
        manager = resources.get(api.constant(f"ResourceManagerType.{name}"))
        if manager is not None:
            total += api.get(api.invoke(manager, "KVCacheManager.get_kv_cache_stats"), "KvCacheStats.allocated_bytes")
    return total
