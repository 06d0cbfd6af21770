"""``load_model`` on TensorRT-LLM: ``create_py_executor`` up to the first KV cache (reference §1,
steps 1-6): mapping and ``Distributed``, ``AttentionRuntimeFeatures``, the target (and draft)
``PyTorchModelEngine``, the derived ``max_seq_len``, and the sampler, which TRT builds before
any KV cache and shares between the estimation and the final executor."""

from __future__ import annotations

from typing import Any

from bootstrap.backends.trtllm.checked_api import TrtllmApi
from bootstrap.backends.trtllm.handles import Engines
from bootstrap.backends.trtllm.llm_args import DRAFT_LEN, attempt_args
from bootstrap.config import BootstrapConfig


def load_engines(api: TrtllmApi, engines: Engines, pristine: Any, config: BootstrapConfig) -> None:
    """Fill ``engines`` (already on the undo) step by step, so a failure leaves what to release."""
    args = engines.args = attempt_args(api, pristine, max_num_tokens=config.max_num_tokens)
    engines.max_batch_size, engines.max_num_tokens = config.max_batch_size, config.max_num_tokens
    parallel = api.get(args, "TorchLlmArgs.parallel_config")
    engines.mapping = api.call("_get_mapping", api.invoke(parallel, "ParallelConfig.to_mapping"))
    engines.dist = api.invoke(api.load("Distributed"), "Distributed.get", engines.mapping)
    engines.features = runtime_features(api, args, config)
    spec = api.get(args, "TorchLlmArgs.speculative_config")
    engines.engine = new_engine(api, engines, config.model, spec, is_draft=False)
    if config.draft_model:
        engines.draft = new_engine(api, engines, config.draft_model, spec, is_draft=True)
    engines.max_seq_len = executor_max_seq_len(api, args, engines.engine, spec)
    engines.sampler = new_sampler(api, engines, spec)


def runtime_features(api: TrtllmApi, args: Any, config: BootstrapConfig) -> Any:
    kv_config = api.get(args, "TorchLlmArgs.kv_cache_config")
    return api.call(
        "AttentionRuntimeFeatures",
        chunked_prefill=False,
        cache_reuse=api.get(kv_config, "KvCacheConfig.enable_block_reuse"),
        has_speculative_draft_tokens=config.draft_model is not None,
        chunk_size=config.max_num_tokens,
    )


def new_engine(api: TrtllmApi, engines: Engines, model_path: str, spec: Any, *, is_draft: bool) -> Any:
    kwargs = {"is_draft_model": True} if is_draft else {}
    return api.call(
        "PyTorchModelEngine",
        model_path=model_path,
        llm_args=engines.args,
        mapping=engines.mapping,
        attn_runtime_features=engines.features,
        dist=engines.dist,
        spec_config=spec,
        **kwargs,
    )


def executor_max_seq_len(api: TrtllmApi, args: Any, engine: Any, spec: Any) -> int:
    """TRT's ``model_engine_max_seq_len``: +1 with the overlap scheduler; a two-model draft adds
    its draft tokens once for the overlap (off here) and once for speculation."""
    max_seq_len = api.get(engine, "PyTorchModelEngine.max_seq_len")
    if not api.get(args, "TorchLlmArgs.disable_overlap_scheduler"):
        max_seq_len += 1
    return max_seq_len + (DRAFT_LEN if spec is not None else 0)


def new_sampler(api: TrtllmApi, engines: Engines, spec: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        max_batch_size=engines.max_batch_size, max_beam_width=1, mm_encoder_only=False, speculative_config=spec
    )
    if api.version == "1.2.1":
        kwargs.update(
            max_seq_len=engines.max_seq_len,
            decoding_config=api.get(engines.args, "TorchLlmArgs.decoding_config"),
            kv_cache_config=api.get(engines.args, "TorchLlmArgs.kv_cache_config"),
            disable_flashinfer_sampling=api.get(engines.args, "TorchLlmArgs.disable_flashinfer_sampling"),
        )
    return api.call("instantiate_sampler", engines.engine, engines.args, engines.mapping, **kwargs)
