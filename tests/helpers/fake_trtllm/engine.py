"""Fake mapping, ``Distributed``, ``AttentionRuntimeFeatures``, ``PyTorchModelEngine``, the
sampler and the speculative-decoding helpers.

``PyTorchModelEngine`` loads its weights at construction (the largest allocation, tagged
``trtllm/weights``; freed when the engine is collected, as torch frees parameters); ``warmup``
captures CUDA graphs (``trtllm/cuda_graphs``) that stay until ``_release_cuda_graphs()``, and
sets ``attn_metadata`` (py_executor.py runs ``model_engine.warmup`` in ``PyExecutor.__init__``).
Sizes come from the project's simulated-GPU formulas (weights, activations, sampler state).
"""

from __future__ import annotations

import copy
from typing import Any

from bootstrap.backends.activations import activation_peak, sampler_state_bytes, weight_dtype_bytes
from bootstrap.backends.sim.backend import rank_weight_bytes
from bootstrap.capacity.presets import resolve_model_shape
from helpers.fake_trtllm import checked, export

GRAPH_BYTES_PER_BATCH_SLOT = 2 * 1024**2  # captured CUDA graphs' private pool, per batch size


@export("fake:Mapping")
class Mapping:
    def __init__(self, *, world_size: int = 1, tp_size: int = 1, rank: int = 0) -> None:
        self.world_size, self.tp_size, self.rank = world_size, tp_size, rank
        self.pp_size, self.enable_attention_dp, self.cp_config = 1, False, {}


@export("_get_mapping")
@checked("_get_mapping")
def _get_mapping(trt: Any, _mapping: Any) -> Any:
    mapping = copy.deepcopy(_mapping)
    mapping.rank = 0  # tensorrt_llm.mpi_rank() of a single process
    return mapping


@export("Distributed")
class Distributed:
    def __init__(self, mapping: Any = None) -> None:
        self.mapping = mapping

    @classmethod
    @checked("Distributed.get")
    def get(cls, mapping: Any) -> Any:
        return cls(mapping)

    @checked("Distributed.broadcast")
    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return obj  # one rank


@export("AttentionRuntimeFeatures")
class AttentionRuntimeFeatures:
    @checked("AttentionRuntimeFeatures")
    def __init__(self, chunked_prefill=False, cache_reuse=False, has_speculative_draft_tokens=False, chunk_size=None):
        self.chunked_prefill, self.cache_reuse = chunked_prefill, cache_reuse
        self.has_speculative_draft_tokens, self.chunk_size = has_speculative_draft_tokens, chunk_size


@export("PyTorchModelEngine")
class PyTorchModelEngine:
    @checked("PyTorchModelEngine")
    def __init__(
        self,
        *,
        model_path: str,
        llm_args: Any,
        mapping: Any = None,
        attn_runtime_features: Any = None,
        dist: Any = None,
        spec_config: Any = None,
        is_draft_model: bool = False,
        **_unused: Any,
    ) -> None:
        self.shape = resolve_model_shape(model_path)
        self.mapping, self.dist, self.spec_config, self.is_draft_model = mapping, dist, spec_config, is_draft_model
        self.dtype_bytes = weight_dtype_bytes(llm_args.dtype if llm_args.dtype != "auto" else "bfloat16")
        self.batch_size, self.max_num_tokens = llm_args.max_batch_size, llm_args.max_num_tokens
        self.max_seq_len = llm_args.max_seq_len or self.shape.max_position_embeddings
        self._max_cuda_graph_batch_size = self.batch_size
        self.attn_metadata: Any = None
        self._graphs: list[Any] = []
        tp = mapping.tp_size if mapping is not None else 1
        self._weights = self._trt.allocate(rank_weight_bytes(self.shape, self.dtype_bytes, tp), "trtllm/weights", self)
        self._trt.log.append(f"load {'draft ' if is_draft_model else ''}engine {model_path}")

    @property
    def kv_cache_manager_key(self) -> Any:
        kind = self._trt.cls("ResourceManagerType")
        return kind.DRAFT_KV_CACHE_MANAGER if self.is_draft_model else kind.KV_CACHE_MANAGER

    def warmup(self, resource_manager: Any) -> None:
        """CUDA-graph capture (called by ``PyExecutor.__init__``); a second capture without
        ``_release_cuda_graphs()`` keeps the first graphs too, as TRT would."""
        nbytes = GRAPH_BYTES_PER_BATCH_SLOT * self._max_cuda_graph_batch_size
        self._graphs.append(self._trt.allocate(nbytes, "trtllm/cuda_graphs", self))
        self.attn_metadata = object()

    @checked("PyTorchModelEngine._release_cuda_graphs")
    def _release_cuda_graphs(self) -> None:
        for graphs in self._graphs:
            graphs.release()
        self._graphs.clear()

    def forward_bytes(self, num_tokens: int) -> int:
        return activation_peak(
            self.shape,
            max_num_tokens=num_tokens,
            max_seq_len=self.max_seq_len,
            dtype_bytes=self.dtype_bytes,
            tp=self.mapping.tp_size,
        ).total


@export("fake:TorchSampler")
class TorchSampler:
    """``TorchSampler.Args``-sized state: per sequence slot, ``max_seq_len`` tokens (int32)."""

    def __init__(self, *, max_num_sequences: int, max_seq_len: int, vocab_size: int) -> None:
        nbytes = max_num_sequences * max_seq_len * 4 + sampler_state_bytes(max_num_sequences, vocab_size)
        self._state = self._trt.allocate(nbytes, "trtllm/sampler", self)


@export("instantiate_sampler")
@checked("instantiate_sampler")
def instantiate_sampler(
    trt: Any,
    engine: Any,
    llm_args: Any,
    mapping: Any,
    *,
    max_batch_size: int,
    max_beam_width: int,
    mm_encoder_only: bool,
    speculative_config: Any,
    max_num_sequences: int | None = None,
    max_seq_len: int | None = None,
    **_v121: Any,
) -> Any:
    slots = max_num_sequences or max_batch_size  # compute_max_num_sequences without PP
    length = max_seq_len or engine.max_seq_len  # main sizes from engine.max_seq_len
    return trt.cls("fake:TorchSampler")(max_num_sequences=slots, max_seq_len=length, vocab_size=engine.shape.vocab_size)


@export("get_spec_resource_manager")
@checked("get_spec_resource_manager")
def get_spec_resource_manager(trt: Any, model_engine: Any, draft_model_engine: Any = None) -> Any:
    return None if draft_model_engine is None else {"kind": "draft-target spec resources"}


@export("get_spec_drafter")
@checked("get_spec_drafter")
def get_spec_drafter(
    trt: Any,
    model_engine: Any,
    draft_model_engine: Any,
    sampler: Any,
    spec_resource_manager: Any = None,
    guided_decoder: Any = None,
) -> Any:
    return None if draft_model_engine is None else trt.cls("fake:ModelDrafter")(draft_model_engine)


@export("fake:ModelDrafter")
class ModelDrafter:
    def __init__(self, draft_model_engine: Any) -> None:
        self.draft_model_engine = draft_model_engine
