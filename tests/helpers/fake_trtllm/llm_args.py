"""Fake ``tensorrt_llm.llmapi.llm_args``: TorchLlmArgs, KvCacheConfig, DraftTargetDecodingConfig.

Pydantic models in TensorRT-LLM; here a small base with the same contract the adapter relies on:
keyword construction of known fields only, attribute access, and ``model_copy(*, update, deep)``
that (like pydantic's) copies without validating. Defaults are TensorRT-LLM's.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from helpers.fake_trtllm import checked, export


class FakeModel:
    FIELDS: ClassVar[dict[str, Any]] = {}

    def __init__(self, **values: Any) -> None:
        unknown = set(values) - set(self.FIELDS)
        if unknown:
            raise TypeError(f"{type(self).__name__}: unexpected fields {sorted(unknown)}")
        for name, default in self.FIELDS.items():
            setattr(self, name, values.get(name, copy.deepcopy(default)))

    def _copy(self, update: dict[str, Any] | None, deep: bool) -> Any:
        new = copy.deepcopy(self) if deep else copy.copy(self)
        for name, value in (update or {}).items():
            setattr(new, name, value)
        return new


@export("KvCacheConfig")
class KvCacheConfig(FakeModel):
    FIELDS: ClassVar[dict[str, Any]] = dict(
        free_gpu_memory_fraction=0.9,
        max_tokens=None,
        max_gpu_total_bytes=0,
        host_cache_size=None,
        tokens_per_block=32,
        dtype="auto",
        max_attention_window=None,
        enable_block_reuse=True,
        use_kv_cache_manager_v2=False,
        pool_ratio=None,
        avg_seq_len=None,
        max_util_for_resume=0.95,
    )

    @checked("KvCacheConfig")
    def __init__(self, **values: Any) -> None:
        fraction = values.get("free_gpu_memory_fraction", 0.9)
        if fraction is not None and not 0.0 <= fraction <= 1.0:  # TRT's validator allows 1.0; V1 asserts < 1.0 later
            raise ValueError(f"free_gpu_memory_fraction must be in [0, 1], got {fraction}")
        super().__init__(**values)

    @checked("KvCacheConfig.model_copy")
    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Any:
        return self._copy(update, deep)


@export("DraftTargetDecodingConfig")
class DraftTargetDecodingConfig(FakeModel):
    FIELDS: ClassVar[dict[str, Any]] = dict(max_draft_len=None, speculative_model=None)

    @checked("DraftTargetDecodingConfig")
    def __init__(self, **values: Any) -> None:
        super().__init__(**values)


@export("fake:ParallelConfig")
class ParallelConfig:
    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size

    @checked("ParallelConfig.to_mapping")
    def to_mapping(self) -> Any:
        return self._trt.cls("fake:Mapping")(world_size=self.tp_size, tp_size=self.tp_size, rank=0)


@export("TorchLlmArgs")
class TorchLlmArgs(FakeModel):
    FIELDS: ClassVar[dict[str, Any]] = dict(
        model=None,
        tensor_parallel_size=1,
        dtype="auto",
        max_batch_size=2048,
        max_num_tokens=8192,
        max_seq_len=None,
        max_beam_width=1,
        kv_cache_config=None,
        speculative_config=None,
        disable_overlap_scheduler=False,
        cuda_graph_config={"enable_padding": False},
        decoding_config=None,
        disable_flashinfer_sampling=False,
    )

    @checked("TorchLlmArgs")
    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        if self.kv_cache_config is None:
            self.kv_cache_config = self._trt.cls("KvCacheConfig")()

    @property
    def parallel_config(self) -> Any:
        return self._trt.cls("fake:ParallelConfig")(self.tensor_parallel_size)

    @checked("TorchLlmArgs.model_copy")
    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Any:
        return self._copy(update, deep)
