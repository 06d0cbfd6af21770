"""Fake ``KvCacheCreator`` (tensorrt_llm/_torch/pyexecutor/_util.py), the parts the adapter
drives: the constructor snapshots the user values and picks the manager class
(``use_kv_cache_manager_v2``); ``try_prepare_estimation`` computes ``_get_token_num_for_estimation``
(dummy requests' blocks, the CUDA-graph warmup floor, ``batch_size``, V2 pool groups, beam width;
V1 capped by what ``free_gpu_memory_fraction`` of the free memory holds) and writes
``max_tokens`` (``min`` with the user's), ``pool_ratio = None``, ``avg_seq_len = max_seq_len`` and
(V2) ``max_gpu_total_bytes = int(fraction * free)`` into the config it was given, in place, as
TRT does; ``build_managers`` / ``_create_kv_cache_manager`` / ``teardown_managers`` as in TRT.
"""

from __future__ import annotations

import math
from typing import Any

from helpers.fake_trtllm import checked, export
from helpers.fake_trtllm.kv import static_cost


@export("KvCacheCreator")
class KvCacheCreator:
    @checked("KvCacheCreator")
    def __init__(
        self,
        *,
        model_engine: Any,
        draft_model_engine: Any,
        mapping: Any,
        net_max_seq_len: int,
        kv_connector_manager: Any,
        max_num_tokens: int,
        max_beam_width: int,
        tokens_per_block: int,
        max_seq_len: int,
        max_batch_size: int,
        kv_cache_config: Any,
        llm_args: Any,
        speculative_config: Any,
        sparse_attention_config: Any,
        profiling_stage_data: Any,
        is_disagg: bool = False,
        execution_stream: Any = None,
        draft_config: Any = None,
        skip_est: bool = False,
    ) -> None:
        self._model_engine, self._draft_model_engine, self._mapping = model_engine, draft_model_engine, mapping
        self._kv_cache_config = kv_cache_config
        self._max_kv_tokens_in = kv_cache_config.max_tokens
        self._max_gpu_total_bytes_in = kv_cache_config.max_gpu_total_bytes
        self._max_num_tokens, self._max_beam_width, self._tokens_per_block = (
            max_num_tokens,
            max_beam_width,
            tokens_per_block,
        )
        self._max_seq_len, self._max_batch_size, self._net_max_seq_len = max_seq_len, max_batch_size, net_max_seq_len
        self._speculative_config, self._skip_est, self._dummy_reqs = speculative_config, skip_est, None
        v2 = kv_cache_config.use_kv_cache_manager_v2 and self._trt.version != "1.2.1"
        self._kv_cache_manager_cls = self._trt.cls("fake:KVCacheManagerV2" if v2 else "fake:KVCacheManager")

    @checked("KvCacheCreator.try_prepare_estimation")
    def try_prepare_estimation(self) -> bool:
        if self._skip_est:
            return False
        config = self._kv_cache_config
        estimate = self._get_token_num_for_estimation()
        config.max_tokens = min(estimate, config.max_tokens) if config.max_tokens is not None else estimate
        config.pool_ratio, config.avg_seq_len = None, self._max_seq_len
        if self._kv_cache_manager_cls.IS_V2:
            budget = int(config.free_gpu_memory_fraction * self._trt.device.free_bytes())
            if self._max_gpu_total_bytes_in and self._max_gpu_total_bytes_in > 0:
                budget = min(budget, self._max_gpu_total_bytes_in)
            config.max_gpu_total_bytes = budget
        return True

    def _get_token_num_for_estimation(self) -> int:
        extra = 1 + (0 if self._speculative_config is None else self._speculative_config.max_draft_len)
        if self._dummy_reqs is None:
            self._dummy_reqs = self._create_dummy_context_requests(max(1, self._net_max_seq_len - 1))
        tpb, engine = self._tokens_per_block, self._model_engine
        blocks = sum(math.ceil((len(r.input_token_ids) + extra) / tpb) for r in self._dummy_reqs)
        warmup = (
            math.ceil((engine.max_seq_len + 1) / tpb) + min(engine.batch_size, engine._max_cuda_graph_batch_size) - 1
        )
        blocks = max(blocks, warmup, engine.batch_size)
        if self._kv_cache_manager_cls.IS_V2:
            windows = {min(w, engine.max_seq_len) for w in (self._kv_cache_config.max_attention_window or [0])}
            blocks *= max(len(windows - {0}), 1)
        tokens = blocks * self._max_beam_width * tpb
        if self._kv_cache_manager_cls.IS_V2:
            return tokens
        slope, intercept = self._get_kv_size_per_token()
        room = self._kv_cache_config.free_gpu_memory_fraction * self._trt.device.free_bytes()
        return min(tokens, int(max((room - intercept) // slope, 0)) // tpb * tpb)

    def _get_kv_size_per_token(self) -> tuple[int, int]:
        slope, intercept = 0, 0
        for engine in (self._model_engine, self._draft_model_engine):
            if engine is not None:
                s, i = static_cost(
                    self._kv_cache_manager_cls,
                    engine,
                    self._kv_cache_config,
                    max_seq_len=self._max_seq_len,
                    max_batch_size=self._max_batch_size,
                )
                slope, intercept = slope + s, intercept + i
        return slope, intercept

    def _create_dummy_context_requests(self, input_seq_len: int) -> list[Any]:
        request, remaining, requests = self._trt.cls("Request"), self._max_num_tokens, []
        length = min(self._max_num_tokens, input_seq_len)
        while remaining > 0:
            length = min(length, remaining)
            requests.append(request([0] * length, max_tokens=1, streaming=False, end_id=-1))
            remaining -= length
        return requests

    @checked("KvCacheCreator.build_managers")
    def build_managers(self, resources: dict, estimating_kv_cache: bool = False) -> None:
        """Shared ``kv_cache_config`` for target and draft (1.2.1, and main's V1 non-VSWA path)."""
        kinds = self._trt.cls("ResourceManagerType")
        target = self._create_kv_cache_manager(self._model_engine, estimating_kv_cache)
        draft = None
        if self._draft_model_engine is not None:
            draft = self._create_kv_cache_manager(self._draft_model_engine, estimating_kv_cache)
        resources[kinds.KV_CACHE_MANAGER] = target
        resources[kinds.DRAFT_KV_CACHE_MANAGER] = draft

    @checked("KvCacheCreator._create_kv_cache_manager")
    def _create_kv_cache_manager(
        self,
        model_engine: Any,
        estimating_kv_cache: bool = False,
        kv_cache_config_override: Any = None,
        cold_page_codec_provider: Any = None,
    ) -> Any:
        config = kv_cache_config_override if kv_cache_config_override is not None else self._kv_cache_config
        if estimating_kv_cache and config.host_cache_size:  # main: _drop_explicit_offload_tier_budgets
            config = config.model_copy(update={"host_cache_size": None})
        manager = self._kv_cache_manager_cls(
            config,
            model_engine,
            max_seq_len=self._max_seq_len,
            max_batch_size=self._max_batch_size,
            max_num_tokens=self._max_num_tokens,
            estimating=estimating_kv_cache and not self._skip_est,
        )
        self._max_seq_len = min(self._max_seq_len, manager.max_seq_len)
        return manager

    @checked("KvCacheCreator.teardown_managers")
    def teardown_managers(self, resources: dict) -> None:
        kinds = self._trt.cls("ResourceManagerType")
        resources[kinds.KV_CACHE_MANAGER].shutdown()
        del resources[kinds.KV_CACHE_MANAGER]
        draft = resources[kinds.DRAFT_KV_CACHE_MANAGER]  # KeyError without the key, as in TRT
        if draft:
            draft.shutdown()
        del resources[kinds.DRAFT_KV_CACHE_MANAGER]
