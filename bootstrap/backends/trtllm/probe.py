"""``estimation_build`` and ``profiling`` on TensorRT-LLM (reference §1 steps 9-14, §2 stages 2-3).

The estimation build is TRT's own: a ``KvCacheCreator`` on a private ``KvCacheConfig`` copy,
``try_prepare_estimation`` (its dummy requests and probe size, further capped to the stage's
``probe_tokens``), ``build_managers(estimating_kv_cache=True)`` and an estimation ``PyExecutor``
without worker. Profiling is the first half of ``configure_kv_cache_capacity``, measured through
the device port instead of ``torch.cuda``; the second half (the budget) is the ``capacity`` stage.

``PyExecutor.shutdown()`` also shuts its KV managers down and an executor cannot be restarted,
so a profiling retry re-arms the probe: fresh creator, managers and executor for the smaller
``max_num_tokens``, in the same holder the estimation's undo releases.
"""

from __future__ import annotations

from typing import Any

from bootstrap.backends.artifacts import EstimationBuild, LoadedModel
from bootstrap.backends.trtllm.checked_api import TrtllmApi
from bootstrap.backends.trtllm.handles import Build, Engines
from bootstrap.backends.trtllm.llm_args import private_kv_config
from bootstrap.backends.trtllm.teardown import kv_allocated_bytes, release_build, stop_executor
from bootstrap.capacity import MemoryProfile
from bootstrap.devices import Device


class EstimationUnsupported(NotImplementedError):
    """TensorRT-LLM turns estimation off for this model (encoder-decoder, context parallelism,
    VANILLA attention, skip_est): there is no probe to profile."""


def build_probe(api: TrtllmApi, engines: Engines, build: Build, *, probe_tokens: int, max_num_tokens: int) -> None:
    """Creator, estimation managers and the estimation executor, into ``build`` (on the undo)."""
    kv_config = private_kv_config(api, engines.args)
    creator = new_creator(api, engines, kv_config, max_num_tokens=max_num_tokens)
    build.creators.append(creator)
    build.max_num_tokens = max_num_tokens
    if not api.invoke(creator, "KvCacheCreator.try_prepare_estimation"):
        raise EstimationUnsupported(
            "TensorRT-LLM skips KV cache estimation for this model (encoder-decoder, context parallelism, "
            "VANILLA attention or skip_est); the staged pipeline needs the estimation pass"
        )
    build.probe_tokens = min(api.get(kv_config, "KvCacheConfig.max_tokens"), probe_tokens)
    api.put(kv_config, "KvCacheConfig.max_tokens", build.probe_tokens)
    api.invoke(creator, "KvCacheCreator.build_managers", resources=build.resources, estimating_kv_cache=True)
    build.max_seq_len = api.get(creator, "KvCacheCreator._max_seq_len")
    build.executor = new_executor(api, engines, build)


def new_creator(api: TrtllmApi, engines: Engines, kv_config: Any, *, max_num_tokens: int) -> Any:
    kwargs: dict[str, Any] = {"is_disagg": False} if api.version != "1.2.1" else {}
    return api.call(
        "KvCacheCreator",
        model_engine=engines.engine,
        draft_model_engine=engines.draft,
        mapping=engines.mapping,
        net_max_seq_len=api.get(engines.engine, "PyTorchModelEngine.max_seq_len"),
        kv_connector_manager=None,
        max_num_tokens=max_num_tokens,
        max_beam_width=1,
        tokens_per_block=api.get(kv_config, "KvCacheConfig.tokens_per_block"),
        max_seq_len=engines.max_seq_len,
        max_batch_size=engines.max_batch_size,
        kv_cache_config=kv_config,
        llm_args=engines.args,
        speculative_config=api.get(engines.args, "TorchLlmArgs.speculative_config"),
        sparse_attention_config=None,
        profiling_stage_data=None,
        **kwargs,
    )


def new_executor(api: TrtllmApi, engines: Engines, build: Build) -> Any:
    """Spec resource manager, drafter and ``create_py_executor_instance(start_worker=False)``:
    the scheduler is built in there, and ``PyExecutor.__init__`` runs the engines' warmup."""
    spec_manager = api.call("get_spec_resource_manager", engines.engine, engines.draft)
    if spec_manager is not None:
        build.resources[api.constant("ResourceManagerType.SPEC_RESOURCE_MANAGER")] = spec_manager
    drafter = api.call(
        "get_spec_drafter",
        engines.engine,
        engines.draft,
        engines.sampler,
        spec_resource_manager=spec_manager,
        guided_decoder=None,
    )
    return api.call(
        "create_py_executor_instance",
        dist=engines.dist,
        resources=build.resources,
        mapping=engines.mapping,
        llm_args=engines.args,
        ctx_chunk_config=None,
        model_engine=engines.engine,
        start_worker=False,
        sampler=engines.sampler,
        drafter=drafter,
        kv_connector_manager=None,
        max_seq_len=build.max_seq_len,
        max_batch_size=engines.max_batch_size,
        max_beam_width=1,
        max_num_tokens=build.max_num_tokens,
        virtual_memory_pools=None,
    )


def estimation_artifact(api: TrtllmApi, build: Build) -> EstimationBuild:
    return EstimationBuild(
        handle=build,
        probe_tokens=build.probe_tokens,
        probe_kv_bytes=kv_allocated_bytes(api, build.resources),
        max_num_tokens=build.max_num_tokens,
    )


def profile_probe(
    api: TrtllmApi, device: Device, loaded: LoadedModel, estimation: EstimationBuild, max_num_tokens: int
) -> MemoryProfile:
    build: Build = estimation.handle
    if build.spent or build.max_num_tokens != max_num_tokens:
        release_build(api, device, loaded.handle, build)
        build.shut_down = build.started = False
        build_probe(api, loaded.handle, build, probe_tokens=estimation.probe_tokens, max_num_tokens=max_num_tokens)
    return measure(api, device, build, max_num_tokens)


def measure(api: TrtllmApi, device: Device, build: Build, max_num_tokens: int) -> MemoryProfile:
    """The dummy run of ``configure_kv_cache_capacity``; the executor is shut down either way."""
    probe_bytes = kv_allocated_bytes(api, build.resources)
    device.empty_cache()
    device.reset_peak()
    total, free_before, before = device.total_bytes(), device.free_bytes(), device.allocated_bytes()
    executor = build.executor
    req_ids = enqueue_dummies(api, build)
    api.put(executor, "PyExecutor.is_warmup", True)
    try:
        api.invoke(executor, "PyExecutor.start_worker")
        build.started = True
        raise_on_error(api, api.invoke(executor, "PyExecutor.await_responses", req_ids))
        torch_peak = device.peak_bytes()
        device.empty_cache()
        used, torch_used = total - device.free_bytes(), device.allocated_bytes()
    finally:
        api.put(executor, "PyExecutor.is_warmup", False)
        stop_executor(api, build)
    return MemoryProfile(
        total_bytes=total,
        free_before_bytes=free_before,
        model_bytes=max(before - probe_bytes, 0),
        torch_peak_bytes=torch_peak,
        torch_used_bytes=torch_used,
        used_bytes=used,
        probe_kv_bytes=probe_bytes,
        max_num_tokens=max_num_tokens,
    )


def enqueue_dummies(api: TrtllmApi, build: Build) -> list[int]:
    executor = build.executor
    api.invoke(executor, "PyExecutor.set_gather_responses", True)
    dummies = api.get(build.creators[0], "KvCacheCreator._dummy_reqs")
    req_ids = api.invoke(executor, "PyExecutor.enqueue_requests", dummies)
    return api.invoke(api.get(executor, "PyExecutor.dist"), "Distributed.broadcast", req_ids, root=0)


def raise_on_error(api: TrtllmApi, responses: list[Any]) -> None:
    """As TRT does: a response with an error (an OOM in the worker, say) raises its message."""
    for item in responses:
        for response in item if isinstance(item, list) else [item]:
            if api.invoke(response, "LlmResponse.has_error"):
                raise RuntimeError(api.get(response, "LlmResponse.error_msg"))
