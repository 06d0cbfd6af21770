"""TensorRT-LLM arguments from a `BootstrapConfig`, and the copies every attempt works on.

TensorRT-LLM mutates what it is given (``KvCacheCreator`` writes ``max_tokens``,
``max_gpu_total_bytes``, ``pool_ratio`` into its ``kv_cache_config``; the creator flow flips
``enable_block_reuse`` and ``disable_overlap_scheduler``), so nothing here is ever handed over
twice: every attempt gets a deep copy of the pristine ``TorchLlmArgs``, and every KV manager its
own ``KvCacheConfig`` copy.
"""

from __future__ import annotations

from typing import Any

from bootstrap.backends.artifacts import ResolvedClasses
from bootstrap.backends.trtllm.checked_api import TrtllmApi
from bootstrap.capacity.pricing import attention_windows
from bootstrap.capacity.split import PoolBudget
from bootstrap.config import BootstrapConfig

DRAFT_LEN = 4  # draft tokens per step for two-model speculative decoding (DraftTargetDecodingConfig)


def user_llm_args(api: TrtllmApi, config: BootstrapConfig, resolved: ResolvedClasses) -> Any:
    """``TorchLlmArgs`` as a TensorRT-LLM user would write them for ``config``."""
    spec = None
    if config.draft_model:
        spec = api.call("DraftTargetDecodingConfig", max_draft_len=DRAFT_LEN, speculative_model=config.draft_model)
    return api.call(
        "TorchLlmArgs",
        model=config.model,
        tensor_parallel_size=config.tensor_parallel_size,
        dtype=resolved.dtype,
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
        max_seq_len=resolved.max_seq_len,
        max_beam_width=1,
        kv_cache_config=api.call("KvCacheConfig", **kv_cache_fields(api, config, resolved, draft=spec is not None)),
        speculative_config=spec,
        disable_overlap_scheduler=spec is not None or not config.overlap,  # a draft: TRT's own fallback
    )


def kv_cache_fields(
    api: TrtllmApi, config: BootstrapConfig, resolved: ResolvedClasses, *, draft: bool
) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        free_gpu_memory_fraction=resolved.memory_rule.fraction,
        max_tokens=config.max_kv_tokens,
        max_gpu_total_bytes=config.max_kv_bytes or 0,  # TRT: 0 means unset
        host_cache_size=config.host_cache_bytes,
        tokens_per_block=config.tokens_per_block,
        dtype="fp8" if resolved.kv_dtype == "fp8" else "auto",
        max_attention_window=window_pattern(resolved, draft=draft),
        enable_block_reuse=config.prefix_caching,
    )
    if "use_kv_cache_manager_v2" in param_names(api, "KvCacheConfig"):  # main only
        fields["use_kv_cache_manager_v2"] = resolved.kv_manager == "KVCacheManagerV2"
    return fields


def window_pattern(resolved: ResolvedClasses, *, draft: bool) -> list[int] | None:
    """``max_attention_window``: one window per layer, ``None`` when no layer slides in ``max_seq_len``.

    Full-attention layers get the KV managers' ``max_seq_len`` (``max_seq_len`` + 1 for the overlap
    scheduler, + the draft tokens with a draft model): the managers clamp windows to it, and V2
    treats a window below it as sliding."""
    windows = attention_windows(resolved.shape, resolved.max_seq_len)
    if len(set(windows)) < 2:
        return None
    manager_max_seq_len = resolved.max_seq_len + (DRAFT_LEN if draft else 1)
    return [manager_max_seq_len if w == resolved.max_seq_len else w for w in windows]


def param_names(api: TrtllmApi, symbol_id: str) -> set[str]:
    return {p.name for p in api.manifest.symbol(symbol_id, api.version).params}


def attempt_args(api: TrtllmApi, pristine: Any, *, max_num_tokens: int) -> Any:
    """A deep copy of the pristine arguments for one attempt (never the object TRT saw before)."""
    return api.invoke(pristine, "TorchLlmArgs.model_copy", deep=True, update={"max_num_tokens": max_num_tokens})


def private_kv_config(api: TrtllmApi, args: Any, update: dict[str, Any] | None = None) -> Any:
    """A deep copy of ``args.kv_cache_config`` for one KV creator to mutate as it likes."""
    base = api.get(args, "TorchLlmArgs.kv_cache_config")
    return api.invoke(base, "KvCacheConfig.model_copy", deep=True, update=update or {})


def pool_kv_update(pool: PoolBudget, *, kv_manager: str, user_max_tokens: int | None) -> dict[str, Any]:
    """What one final manager is told: its byte budget, host tier and (V1) token count.

    V1 sizes its primary pool from ``max_tokens`` (and ``max_gpu_total_bytes`` under VSWA); V2
    from ``max_gpu_total_bytes`` alone, ``max_tokens`` staying the user's value (as TRT's
    ``configure_kv_cache_capacity`` leaves it). ``host_cache_size`` is always explicit: V2 would
    otherwise provision a host tier as large as the GPU quota.
    """
    max_tokens = pool.tokens if kv_manager == "KVCacheManager" else user_max_tokens
    return {"max_tokens": max_tokens, "max_gpu_total_bytes": pool.gpu_bytes, "host_cache_size": pool.host_bytes}
