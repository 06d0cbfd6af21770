"""``TrtllmBackend``: the backend protocol on TensorRT-LLM's PyTorch backend objects.

Each method maps one stage onto what ``create_py_executor`` does (reference §1), with the
rollback of that stage pushed on its ``Undo`` before the first allocation. Memory is measured
through the ``Device`` port (``CudaDevice`` on a GPU), never through TensorRT-LLM's globals.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from bootstrap.backends.activations import block_table_bytes
from bootstrap.backends.artifacts import EstimationBuild, FinalBuild, LoadedModel, ResolvedClasses
from bootstrap.backends.trtllm import final, load, probe
from bootstrap.backends.trtllm.checked_api import ImportModule, TrtllmApi
from bootstrap.backends.trtllm.handles import Build, Engines, TrtllmExecutor
from bootstrap.backends.trtllm.llm_args import user_llm_args
from bootstrap.backends.trtllm.teardown import frames_dropped_on_error, release_build, release_engines, stop_executor
from bootstrap.capacity import CapacityPlan, MemoryProfile
from bootstrap.capacity.presets import resolve_model_shape
from bootstrap.capacity.shape import ModelShape
from bootstrap.capacity.split import PoolBudgets
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import Device
from bootstrap.pipeline.undo import Undo


class TrtllmBackend:
    """The stages driving TensorRT-LLM's own ``PyExecutor`` (see the package docstring)."""

    name = "trtllm"
    kv_manager = "KVCacheManager"  # V1 unless kv_manager v2 (resolve_kv_manager)

    def __init__(
        self, device: Device, *, import_module: ImportModule = importlib.import_module, llm_args: Any = None
    ) -> None:
        self.device = device
        self.api = TrtllmApi(import_module)
        self._user_args = llm_args  # never handed to TensorRT-LLM: every attempt works on a deep copy

    def check_config(self, config: BootstrapConfig, shape: ModelShape) -> None:
        """What this adapter cannot do, refused in ``resolve_classes`` before any load."""
        if config.backend != "trtllm":
            raise ConfigError("backend: the TensorRT-LLM backend needs backend 'trtllm' (KV priced as TRT allocates)")
        if config.tensor_parallel_size != 1:
            raise ConfigError(
                f"tensor_parallel_size: {config.tensor_parallel_size}; the trtllm backend drives one rank (retries "
                "across ranks must be agreed collectively, which is not built); use 1, or plan with `bootstrap plan`"
            )
        if config.kv_manager == "v2" and self.api.version == "1.2.1":
            raise ConfigError("kv_manager: 'v2' (KVCacheManagerV2) needs TensorRT-LLM 1.3+ (main); 1.2.1 has only V1")
        if config.kv_manager == "v2" and config.draft_model:
            raise ConfigError(
                "draft_model: TensorRT-LLM's KVCacheManagerV2 requires target and draft to share one unsplit GPU "
                "budget (it asserts so), which this project does not plan; use kv_manager 'v1'"
            )

    def model_shape(self, spec: str) -> ModelShape:
        return resolve_model_shape(spec)

    def kv_caps(self, resolved: ResolvedClasses, config: BootstrapConfig) -> Mapping[str, int]:
        return {}  # TensorRT-LLM fills the GPU; its own caps are the config's

    def default_headroom_bytes(
        self, profile: MemoryProfile | None, resolved: ResolvedClasses, config: BootstrapConfig
    ) -> int | None:
        return None  # TensorRT-LLM's executor has its own transient needs: its own rule applies

    def estimation_overhead_bytes(self, resolved: ResolvedClasses, config: BootstrapConfig) -> int:
        """The estimation ``PyExecutor``'s int32 block tables (target and draft). The sampler exists
        already (``load_model`` builds it, as ``create_py_executor`` does, so free memory counts it);
        graphs captured by the executor's warm-up are measured by ``profiling``, not reserved here."""
        return block_table_bytes(config.max_batch_size, resolved.max_seq_len, config.tokens_per_block, 2)

    def default_dtype(self, shape: ModelShape) -> str:
        return shape.torch_dtype if shape.torch_dtype in ("bfloat16", "float16") else "bfloat16"

    def load_model(self, config: BootstrapConfig, resolved: ResolvedClasses, undo: Undo) -> LoadedModel:
        pristine = self._user_args if self._user_args is not None else user_llm_args(self.api, config, resolved)
        before = self.device.allocated_bytes()
        engines = Engines()
        undo.push(release_engines, self.device, engines)
        with frames_dropped_on_error():
            load.load_engines(self.api, engines, pristine, config)
        return LoadedModel(handle=engines, weight_bytes=self.device.allocated_bytes() - before)

    def build_estimation(
        self, loaded: LoadedModel, resolved: ResolvedClasses, probe_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> EstimationBuild:
        build = Build()
        undo.push(release_build, self.api, self.device, loaded.handle, build)
        with frames_dropped_on_error():
            probe.build_probe(
                self.api, loaded.handle, build, probe_tokens=probe_tokens, max_num_tokens=config.max_num_tokens
            )
        return probe.estimation_artifact(self.api, build)

    def profile(
        self, estimation: EstimationBuild, loaded: LoadedModel, max_num_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> MemoryProfile:
        """The probe is the estimation's to release (its undo runs once profiling consumes it)."""
        with frames_dropped_on_error():
            return probe.profile_probe(self.api, self.device, loaded, estimation, max_num_tokens)

    def build_final(
        self, loaded: LoadedModel, resolved: ResolvedClasses, budgets: PoolBudgets, undo: Undo
    ) -> FinalBuild:
        build = Build()
        undo.push(release_build, self.api, self.device, loaded.handle, build)
        user_kv_config = self.api.get(loaded.handle.args, "TorchLlmArgs.kv_cache_config")
        user_max_tokens = self.api.get(user_kv_config, "KvCacheConfig.max_tokens")
        with frames_dropped_on_error():
            final.build_pools(
                self.api, loaded.handle, build, budgets, kv_manager=resolved.kv_manager, user_max_tokens=user_max_tokens
            )
        return final.final_artifact(self.api, build, budgets)

    def start_executor(
        self,
        loaded: LoadedModel,
        resolved: ResolvedClasses,
        final_build: FinalBuild,
        plan: CapacityPlan,
        config: BootstrapConfig,
        undo: Undo,
    ) -> TrtllmExecutor:
        build: Build = final_build.handle
        undo.push(stop_executor, self.api, build)
        with frames_dropped_on_error():
            executor = final.start(self.api, loaded.handle, build, max_num_tokens=plan.max_num_tokens)
            final.serve_smoke_request(self.api, executor)
        return TrtllmExecutor(executor, build, stop=lambda: stop_executor(self.api, build))
