"""``final_build`` and ``scheduler_sampler`` on TensorRT-LLM (reference §1 steps 15-17).

The budget split is this project's (``budget_split`` stage); each pool becomes its own
``KvCacheConfig`` copy and its own manager, through ``KvCacheCreator._create_kv_cache_manager``
(the per-manager constructor ``build_managers`` calls), so TRT does not split the budget again.
The final executor is ``create_py_executor_instance`` (scheduler inside, warmup in
``PyExecutor.__init__``), then ``_adjust_torch_mem_fraction()`` and ``start_worker()``, as
``create_py_executor`` ends; one smoke request proves it serves.
"""

from __future__ import annotations

from typing import Any

from bootstrap.backends.artifacts import FinalBuild
from bootstrap.backends.trtllm.checked_api import TrtllmApi
from bootstrap.backends.trtllm.handles import Build, Engines
from bootstrap.backends.trtllm.llm_args import pool_kv_update, private_kv_config
from bootstrap.backends.trtllm.probe import new_creator, new_executor, raise_on_error
from bootstrap.capacity.split import PoolBudget, PoolBudgets
from bootstrap.config import ConfigError

POOL_KEYS = {"target": "KV_CACHE_MANAGER", "draft": "DRAFT_KV_CACHE_MANAGER"}
SMOKE_PROMPT = [1, 2, 3, 4]


class FinalBuildGone(RuntimeError):
    """The final executor was shut down, and its KV managers with it: rebuild from final_build."""


def build_pools(
    api: TrtllmApi,
    engines: Engines,
    build: Build,
    budgets: PoolBudgets,
    *,
    kv_manager: str,
    user_max_tokens: int | None,
) -> None:
    build.max_num_tokens = engines.max_num_tokens
    build.max_seq_len = engines.max_seq_len
    for pool in budgets.pools():
        if pool.name not in POOL_KEYS:
            raise ConfigError(  # resolve_classes refuses cross pools first; this guards the mapping below
                "cross_kv_cache_fraction: the trtllm backend builds target and draft pools only, "
                f"not {pool.name!r}; leave it unset"
            )
        update = pool_kv_update(pool, kv_manager=kv_manager, user_max_tokens=user_max_tokens)
        key = api.constant(f"ResourceManagerType.{POOL_KEYS[pool.name]}")
        build.resources[key] = new_pool(api, engines, build, pool, update)
    build.resources.setdefault(api.constant("ResourceManagerType.DRAFT_KV_CACHE_MANAGER"), None)


def new_pool(api: TrtllmApi, engines: Engines, build: Build, pool: PoolBudget, update: dict[str, Any]) -> Any:
    kv_config = private_kv_config(api, engines.args, update)
    creator = new_creator(api, engines, kv_config, max_num_tokens=build.max_num_tokens)
    build.creators.append(creator)
    engine = engines.engine if pool.name == "target" else engines.draft
    manager = api.invoke(
        creator, "KvCacheCreator._create_kv_cache_manager", model_engine=engine, estimating_kv_cache=False
    )
    if pool.name == "target":  # the target manager may shorten max_seq_len (sliding windows), as in TRT
        build.max_seq_len = api.get(creator, "KvCacheCreator._max_seq_len")
    return manager


def final_artifact(api: TrtllmApi, build: Build, budgets: PoolBudgets) -> FinalBuild:
    pool_bytes, pool_tokens = {}, {}
    for pool in budgets.pools():
        manager = build.resources[api.constant(f"ResourceManagerType.{POOL_KEYS[pool.name]}")]
        stats = api.invoke(manager, "KVCacheManager.get_kv_cache_stats")
        pool_bytes[pool.name] = api.get(stats, "KvCacheStats.allocated_bytes")
        pool_tokens[pool.name] = full_window_tokens(api, stats)
    return FinalBuild(handle=build, pool_bytes=pool_bytes, pool_tokens=pool_tokens)


def full_window_tokens(api: TrtllmApi, stats: Any) -> int:
    """Token capacity a full-length request sees: the largest window's blocks when the manager
    keeps one pool per window (V1 VSWA, V2), else all blocks; read before anything is admitted."""
    per_window = api.get(stats, "KvCacheStats.num_free_blocks_per_window_size") or {}
    blocks = per_window[max(per_window)] if len(per_window) > 1 else api.get(stats, "KvCacheStats.max_num_blocks")
    return blocks * api.get(stats, "KvCacheStats.tokens_per_block")


def start(api: TrtllmApi, engines: Engines, build: Build, *, max_num_tokens: int) -> Any:
    """Final executor, torch memory fraction, worker (``build.started`` once the worker runs)."""
    if build.shut_down or not build.resources:
        raise FinalBuildGone("the final KV pools were shut down with a previous executor; retry from final_build")
    build.max_num_tokens = max_num_tokens
    build.executor = new_executor(api, engines, build)
    api.call("_adjust_torch_mem_fraction")
    api.invoke(build.executor, "PyExecutor.start_worker")
    build.started = True
    return build.executor


def serve_smoke_request(api: TrtllmApi, executor: Any) -> None:
    request = api.call(
        "Request",
        SMOKE_PROMPT,
        max_tokens=1,
        streaming=False,
        sampling_config=api.call("SamplingConfig", beam_width=1),
        output_config=api.call("OutputConfig"),
        end_id=-1,
    )
    req_ids = api.invoke(executor, "PyExecutor.enqueue_requests", [request])
    raise_on_error(api, api.invoke(executor, "PyExecutor.await_responses", req_ids))
