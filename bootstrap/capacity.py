"""Pure capacity math: KV bytes per token, the probe size, and profile -> KV budget.

No torch import. The formulas follow TensorRT-LLM's PyTorch backend (see
``shared/reference/tensorrt-llm-executor-creation.md`` §3); where this module differs on
purpose, the docstring says so. Every infeasible case raises `CapacityError` with the figures
(GiB with two decimals and exact bytes) and the config field to change.

The budget split between pools lives in `bootstrap.budget_split` and is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from bootstrap.models.shape import ModelShape

GIB = 1024**3

_KV_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


class CapacityError(ValueError):
    """The configuration cannot fit; the message gives the figures and the knob to turn."""


def fmt_bytes(n: int | float) -> str:
    """``12.34 GiB (13,249,974,108 bytes)``: both the readable and the exact figure."""
    return f"{n / GIB:.2f} GiB ({int(n):,} bytes)"


def _ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_positive(**values: int | float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def kv_share(left: int, fraction: float, headroom_bytes: int | None = None) -> int:
    """The KV cache's share of ``left`` bytes (memory left after the measured peak): TensorRT-LLM's
    ``int(left * free_gpu_memory_fraction)``, or, when ``headroom_bytes`` is given
    (``kv_headroom_bytes``), everything but that many bytes (never below 0)."""
    if headroom_bytes is None:
        return int(left * fraction)
    return max(left - headroom_bytes, 0)


def memory_rule(fraction: float, headroom_bytes: int | None = None) -> str:
    """The config field that shares memory with the KV cache, as error messages name it."""
    return f"free_gpu_memory_fraction {fraction}" if headroom_bytes is None else f"kv_headroom_bytes {headroom_bytes:,}"


@dataclass(frozen=True)
class CacheCost:
    """KV cost of a pool: ``bytes(tokens) = slope * tokens + intercept``.

    ``slope`` is bytes per cached token; ``intercept`` is fixed bytes that do not grow with
    tokens (sliding-window and recurrent state for ``max_batch_size`` sequences).
    """

    slope: int
    intercept: int = 0

    def __post_init__(self) -> None:
        for name in ("slope", "intercept"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CacheCost.{name} must be an integer >= 0, got {value!r}")

    def bytes_for_tokens(self, tokens: int) -> int:
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return self.slope * tokens + self.intercept

    def tokens_for_budget(self, budget: int) -> int:
        """Tokens a budget holds after the intercept: ``max((budget - intercept) // slope, 0)``."""
        if self.slope == 0:
            raise CapacityError("a KV pool with no per-token cost (slope 0) has no token capacity")
        return max((budget - self.intercept) // self.slope, 0)

    def __add__(self, other: CacheCost) -> CacheCost:
        if not isinstance(other, CacheCost):
            return NotImplemented
        return CacheCost(self.slope + other.slope, self.intercept + other.intercept)


def kv_dtype_bytes(name: str) -> int | float:
    """Bytes per KV element for a resolved ``kv_cache_dtype`` (not "auto")."""
    try:
        return _KV_DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(_KV_DTYPE_BYTES)}, got {name!r}") from None


def _kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads one rank caches: ``ceil(kv_heads / tp)``.

    With fewer KV heads than ranks each head is replicated, so every rank still holds one head
    (TensorRT-LLM divides ``kv_heads / tp`` as a float, which under-counts that case).
    """
    return -(-kv_heads // tp)


def mha_cost(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int | float, tp: int = 1) -> CacheCost:
    """MHA/GQA/MQA on one rank: ``2 * layers * ceil(kv_heads / tp) * head_dim * dtype_bytes``."""
    _check_positive(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, tp=tp)
    return CacheCost(math.ceil(2 * layers * _kv_heads_per_rank(kv_heads, tp) * head_dim * dtype_bytes))


def mla_cost(*, layers: int, kv_lora_rank: int, rope_dim: int, dtype_bytes: int | float) -> CacheCost:
    """MLA latent cache: ``layers * (kv_lora_rank + rope_dim) * dtype_bytes`` (K only, no TP split)."""
    _check_positive(layers=layers, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, dtype_bytes=dtype_bytes)
    return CacheCost(math.ceil(layers * (kv_lora_rank + rope_dim) * dtype_bytes))


def _layer_bytes_per_token(shape: ModelShape, dtype_bytes: int | float, tp: int) -> int:
    if shape.kv_lora_rank is not None:
        return mla_cost(layers=1, kv_lora_rank=shape.kv_lora_rank, rope_dim=shape.qk_rope_head_dim,
                        dtype_bytes=dtype_bytes).slope
    return mha_cost(layers=1, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                    dtype_bytes=dtype_bytes, tp=tp).slope


def model_cost(
    shape: ModelShape,
    *,
    kv_dtype_bytes: int | float,
    tp: int,
    max_batch_size: int,
    tokens_per_block: int,
    max_seq_len: int | None = None,
) -> CacheCost:
    """Cost of a model's KV cache on one rank, for requests of at most ``max_seq_len`` tokens
    (default: the model's ``max_position_embeddings``).

    A window of ``max_seq_len`` tokens or more never slides, so such a layer is priced as full
    attention (TensorRT-LLM treats attention as SWA only when ``max_seq_len > min(window)``).
    Full-attention layers go to the slope. Each sliding-window layer adds
    ``max_batch_size * ceil(window / tpb) * tpb * layer_bytes`` to the intercept (TensorRT-LLM V2's
    ``gen_swa_req``; its context-phase SWA term is left out: windows are priced at full length,
    which already bounds a request). When *every* attention layer is windowed the layers are
    priced as full attention instead, so the slope stays positive and errs on the safe side.
    Recurrent state adds ``max_batch_size * ceil(state_elements / tp) * layers * dtype_bytes``
    (the state shards with the Mamba inner dimension; it uses the KV dtype).
    """
    per_layer = _checked_layer_bytes(shape, kv_dtype_bytes, tp, max_batch_size, tokens_per_block)
    longest = max_seq_len if max_seq_len is not None else shape.max_position_embeddings
    windows = shape.attention_windows
    sliding = [w for w in windows if w is not None and w < longest]
    if len(sliding) == len(windows):
        sliding = []
    slope = (len(windows) - len(sliding)) * per_layer
    window_bytes = sum(_ceil_to(w, tokens_per_block) * per_layer for w in sliding)
    return CacheCost(slope, max_batch_size * (window_bytes + _recurrent_state_bytes(shape, kv_dtype_bytes, tp)))


def probe_cost(
    shapes: Iterable[ModelShape | None], *, kv_dtype_bytes: int | float, tp: int, max_batch_size: int
) -> CacheCost:
    """Cost of the estimation probe of the models in ``shapes`` (target, draft; ``None`` skipped).

    Every attention layer, windowed or not, holds every probe token: TensorRT-LLM's V1 estimation
    managers give each window the same ``max_tokens // tpb`` blocks (``is_estimating_kv_cache``),
    and its V1 cost per token counts every layer at full length. That bounds what the dummy
    workload needs (a windowed layer keeps at most its window of each dummy request). The plan's
    per-sequence window state (``model_cost``'s intercept, ``max_batch_size`` live sequences) is
    left out: the dummies are a few requests, not ``max_batch_size`` windows. Recurrent state stays
    (the V1 estimation managers keep ``max_batch_size`` state slots).
    """
    total = CacheCost(0)
    for shape in (s for s in shapes if s is not None):
        per_layer = _checked_layer_bytes(shape, kv_dtype_bytes, tp, max_batch_size, 1)
        state = max_batch_size * _recurrent_state_bytes(shape, kv_dtype_bytes, tp)
        total = total + CacheCost(len(shape.attention_windows) * per_layer, state)
    return total


def _checked_layer_bytes(shape: ModelShape, kv_dtype_bytes: int | float, tp: int, max_batch_size: int,
                         tokens_per_block: int) -> int:  # fmt: skip
    _check_positive(tp=tp, max_batch_size=max_batch_size, tokens_per_block=tokens_per_block)
    if shape.num_heads % tp:
        raise CapacityError(
            f"tensor_parallel_size ({tp}) must divide the {shape.num_heads} attention heads of "
            f"{shape.architecture}; choose a divisor of {shape.num_heads}"
        )
    return _layer_bytes_per_token(shape, kv_dtype_bytes, tp)


def _recurrent_state_bytes(shape: ModelShape, kv_dtype_bytes: int | float, tp: int) -> int:
    """One sequence's recurrent state on one rank, every recurrent layer."""
    return shape.num_recurrent_layers * math.ceil(-(-shape.recurrent_state_elements // tp) * kv_dtype_bytes)


def dummy_request_lengths(max_num_tokens: int, max_seq_len: int) -> list[int]:
    """Prompt lengths of the profiling dummies: ``max_num_tokens`` cut into requests of
    ``min(max_num_tokens, max_seq_len - 1)`` tokens, the remainder last (reference §3.1)."""
    _check_positive(max_num_tokens=max_num_tokens)
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    length = min(max_num_tokens, max_seq_len - 1)
    full, rest = divmod(max_num_tokens, length)
    return [length] * full + ([rest] if rest else [])


def dummy_workload_tokens(*, max_num_tokens: int, max_seq_len: int, tokens_per_block: int) -> int:
    """KV tokens the profiling dummies occupy at once: ``sum(ceil((len + 1) / tpb)) * tpb`` over
    ``dummy_request_lengths`` (one generated token each). The smallest probe that runs the dummy
    workload of ``max_num_tokens`` in one step."""
    _check_positive(tokens_per_block=tokens_per_block)
    lengths = dummy_request_lengths(max_num_tokens, max_seq_len)
    return sum(-(-(n + 1) // tokens_per_block) for n in lengths) * tokens_per_block


def estimation_tokens(*, max_num_tokens: int, max_seq_len: int, max_batch_size: int, tokens_per_block: int) -> int:
    """Probe KV capacity in tokens (reference §3.1, one pool group, beam width 1).

    The dummy workload (``dummy_workload_tokens``), but at least one full ``max_seq_len`` request
    plus one block for each other batch slot (TensorRT-LLM's CUDA-graph warm-up floor). Block aligned.
    """
    _check_positive(max_batch_size=max_batch_size, tokens_per_block=tokens_per_block)
    workload = dummy_workload_tokens(max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                                     tokens_per_block=tokens_per_block)  # fmt: skip
    floor = -(-(max_seq_len + 1) // tokens_per_block) + max_batch_size - 1
    return max(workload, floor * tokens_per_block)


def cap_probe_tokens(
    tokens: int,
    *,
    cost: CacheCost,
    free_bytes: int,
    fraction: float,
    tokens_per_block: int,
    overhead_bytes: int = 0,
    max_kv_tokens: int | None = None,
    max_kv_bytes: int | None = None,
    plan_cost: CacheCost | None = None,
    headroom_bytes: int | None = None,
) -> int:
    """The probe size actually allocated, block aligned (reference §3.1): ``tokens`` (aligned up),
    capped by ``max_kv_tokens`` (TensorRT-LLM's ``min(estimate, max_tokens)``, floored to a block,
    at least one) and by what the room holds at the probe's ``cost`` (``probe_cost``). The room is
    ``fraction`` of the free memory once ``overhead_bytes`` are allocated beside the probe
    (TensorRT-LLM V1 reads free memory after its sampler exists), capped by ``max_kv_bytes``
    (V2's estimation quota).

    The probe is added back to the budget, so a smaller probe changes no figure of the plan; it
    only has to leave room for the dummy forward. The room also bounds the final KV budget: when
    it cannot hold one block of the probe, or of ``plan_cost`` (the final pools, with their fixed
    per-sequence state), no plan exists and no retry can help: that is a ``CapacityError`` naming
    what takes the room. With ``headroom_bytes`` (``kv_headroom_bytes``) the room is the free memory
    less that headroom instead of ``fraction`` of it (``kv_share``).
    """
    _check_positive(tokens=tokens, tokens_per_block=tokens_per_block)
    memory = kv_share(free_bytes - overhead_bytes, fraction, headroom_bytes)
    room = memory if max_kv_bytes is None else min(memory, max_kv_bytes)
    for need in (plan_cost, cost):
        if need is not None and need.tokens_for_budget(room) < tokens_per_block:
            why = "max_kv_bytes" if room < memory else memory_rule(fraction, headroom_bytes)
            raise CapacityError(_no_room(need, free_bytes, tokens_per_block, overhead_bytes, room, why))
    blocks = -(-tokens // tokens_per_block)
    if max_kv_tokens is not None:
        blocks = min(blocks, max(max_kv_tokens // tokens_per_block, 1))
    return min(blocks, cost.tokens_for_budget(room) // tokens_per_block) * tokens_per_block


def _no_room(cost: CacheCost, free_bytes: int, tokens_per_block: int, overhead_bytes: int, room: int, why: str) -> str:
    if overhead_bytes >= free_bytes:
        return (
            f"the temporary executor's state ({fmt_bytes(overhead_bytes)}: sampler buffers and block tables) "
            f"does not fit in the {fmt_bytes(free_bytes)} free after loading the weights, before any KV cache"
            "\n  fix: lower max_batch_size (the sampler's buffers scale with it), lower max_seq_len (block "
            "tables), or use more tensor_parallel_size"
        )
    return (
        f"the KV cache cannot hold one block next to its fixed per-sequence state: "
        f"{fmt_bytes(cost.bytes_for_tokens(tokens_per_block))} needed ({fmt_bytes(cost.intercept)} of "
        f"sliding-window or recurrent state for every batch slot), {fmt_bytes(room)} available (limited by {why}; "
        f"{fmt_bytes(free_bytes)} free after loading the weights, {fmt_bytes(overhead_bytes)} of it for the "
        "executor state)"
        "\n  fix: lower max_batch_size (the fixed state scales with it), use a smaller kv_cache_dtype, "
        "raise free_gpu_memory_fraction or max_kv_bytes, or use more tensor_parallel_size"
    )


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiling run measured, in bytes (``used_bytes`` = total - free after the run).

    ``model_bytes`` is what torch held before the dummy forward *less the probe KV pool*:
    weights plus the probe executor's state. ``probe_kv_bytes`` is counted separately, so every
    backend must measure ``model_bytes`` this way for ``activation_bytes`` to be the forward's.

    ``graph_bytes``: device memory the decode CUDA graphs of the ``warmup`` stage take (their
    memory pool, static outputs and the driver's graph objects), from the probe after the dummy
    forward: the native backend estimates it from one eager decode step of the largest bucket
    (``engine.cuda_graphs.capture_reserve_bytes``); 0 where nothing is captured. It is not part of
    the peak: the graphs stay allocated beside every later step, so the plan reserves it whole.
    """

    total_bytes: int
    free_before_bytes: int
    model_bytes: int
    torch_peak_bytes: int
    torch_used_bytes: int
    used_bytes: int
    probe_kv_bytes: int
    max_num_tokens: int
    graph_bytes: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryProfile.{name} must be an integer >= 0, got {value!r}")
        if self.total_bytes == 0 or self.max_num_tokens == 0:
            raise ValueError("MemoryProfile.total_bytes and max_num_tokens must be positive")

    @property
    def peak_bytes(self) -> int:
        """Torch peak plus memory used outside torch (NCCL, CUDA context, other processes)."""
        return self.torch_peak_bytes + max(self.used_bytes - self.torch_used_bytes, 0)

    @property
    def activation_bytes(self) -> int:
        """Torch peak less weights and probe KV: the forward pass's working memory."""
        return max(self.torch_peak_bytes - self.model_bytes - self.probe_kv_bytes, 0)

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "peak_bytes": self.peak_bytes, "activation_bytes": self.activation_bytes}


LIMITS = ("memory", "max_kv_bytes", "max_kv_tokens")  # and the names of a backend's caps


@dataclass(frozen=True)
class CapacityPlan:
    """The KV budget and token capacity derived from a profile; input to the budget split."""

    total_bytes: int
    peak_bytes: int
    kv_budget_bytes: int
    kv_tokens: int
    cost: CacheCost
    tokens_per_block: int
    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int
    max_concurrent_requests: int  # min(kv_requests, max_batch_size): what can run at once
    kv_requests: int  # requests of max_seq_len the KV pool alone holds
    limited_by: str
    fraction: float
    headroom_bytes: int | None = None  # kv_headroom_bytes: replaces the fraction when set
    graph_bytes: int = 0  # reserved for the warmup stage's CUDA graphs (the profile's figure)

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // self.tokens_per_block

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cost"] = {"slope": self.cost.slope, "intercept": self.cost.intercept}
        out["kv_blocks"] = self.kv_blocks
        return out


def plan_capacity(
    profile: MemoryProfile,
    *,
    cost: CacheCost,
    fraction: float,
    max_seq_len: int,
    max_batch_size: int,
    tokens_per_block: int,
    max_kv_bytes: int | None = None,
    max_kv_tokens: int | None = None,
    caps: Mapping[str, int] | None = None,
    headroom_bytes: int | None = None,
) -> CapacityPlan:
    """KV budget from a profile: ``int((total - peak - graphs + probe_kv) * fraction)`` capped by the
    explicit limits and by the backend's ``caps`` (bytes by name), then block-aligned tokens
    (reference §3.2). ``limited_by`` names the smallest of them.

    Differs from TensorRT-LLM: both caps apply to bytes here (TRT's V2 passes ``max_tokens`` on
    to the manager), and the plan fails now, with figures, when one ``max_seq_len`` request
    cannot fit, instead of at the first long request.

    ``headroom_bytes`` (``kv_headroom_bytes``, not in TensorRT-LLM): the budget is what is left
    after the peak less that many bytes, ``total - peak + probe_kv - headroom_bytes``, instead
    of ``fraction`` of it (``kv_share``); the caps apply the same way.
    """
    if not 0 < fraction <= 1:
        raise CapacityError(f"free_gpu_memory_fraction must be in (0, 1], got {fraction}")
    if headroom_bytes is not None and headroom_bytes < 0:
        raise CapacityError(f"kv_headroom_bytes must be >= 0, got {headroom_bytes}")
    _check_positive(max_seq_len=max_seq_len, max_batch_size=max_batch_size, tokens_per_block=tokens_per_block)
    budget, limited_by = _capped_budget(profile, cost, fraction, max_kv_bytes, max_kv_tokens, headroom_bytes)
    for name, cap in (caps or {}).items():
        if cap < budget:
            budget, limited_by = cap, name
    kv_tokens = cost.tokens_for_budget(budget) // tokens_per_block * tokens_per_block if budget > 0 else 0
    share = (fraction, headroom_bytes)
    if kv_tokens < tokens_per_block:
        raise CapacityError(_too_small(profile, cost, share, budget, limited_by, tokens_per_block, "one KV block"))
    per_request = -(-max_seq_len // tokens_per_block)
    kv_requests = kv_tokens // tokens_per_block // per_request
    if kv_requests < 1:
        what = f"one request of max_seq_len={max_seq_len} ({per_request} blocks)"
        need = per_request * tokens_per_block
        raise CapacityError(_too_small(profile, cost, share, budget, limited_by, need, what))
    return CapacityPlan(
        total_bytes=profile.total_bytes, peak_bytes=profile.peak_bytes, kv_budget_bytes=budget,
        kv_tokens=kv_tokens, cost=cost, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
        max_batch_size=max_batch_size, max_num_tokens=profile.max_num_tokens,
        max_concurrent_requests=min(kv_requests, max_batch_size), kv_requests=kv_requests,
        limited_by=limited_by, fraction=fraction, headroom_bytes=headroom_bytes, graph_bytes=profile.graph_bytes,
    )


def _capped_budget(
    profile: MemoryProfile, cost: CacheCost, fraction: float, max_kv_bytes: int | None, max_kv_tokens: int | None,
    headroom_bytes: int | None,
) -> tuple[int, str]:
    room = profile.total_bytes - profile.peak_bytes - profile.graph_bytes + profile.probe_kv_bytes
    budget = kv_share(room, fraction, headroom_bytes)
    limited_by = "memory"
    if max_kv_tokens is not None and cost.bytes_for_tokens(max_kv_tokens) < budget:
        budget, limited_by = cost.bytes_for_tokens(max_kv_tokens), "max_kv_tokens"
    if max_kv_bytes is not None and max_kv_bytes < budget:
        budget, limited_by = max_kv_bytes, "max_kv_bytes"
    return budget, limited_by


def _too_small(
    profile: MemoryProfile, cost: CacheCost, share: tuple[float, int | None], budget: int, limited_by: str, tokens: int,
    what: str,
) -> str:
    fraction, headroom = share
    need = cost.bytes_for_tokens(tokens)
    lines = [
        f"the KV cache budget cannot hold {what}: budget {fmt_bytes(budget)} (limited by {limited_by}), "
        f"needed {fmt_bytes(need)} = {cost.slope:,} bytes/token x {tokens:,} tokens + {fmt_bytes(cost.intercept)} "
        "fixed per-sequence state",
        f"memory: total {fmt_bytes(profile.total_bytes)}, measured peak {fmt_bytes(profile.peak_bytes)} "
        f"(weights {fmt_bytes(profile.model_bytes)}, activations {fmt_bytes(profile.activation_bytes)}, "
        f"non-torch {fmt_bytes(profile.peak_bytes - profile.torch_peak_bytes)}), CUDA graphs reserved "
        f"{fmt_bytes(profile.graph_bytes)}, probe KV added back "
        f"{fmt_bytes(profile.probe_kv_bytes)}, {memory_rule(fraction, headroom)}",
    ]
    if limited_by != "memory":
        lines.append(f"fix: raise {limited_by} (it caps the budget below what memory allows)")
    else:
        raise_fraction = _more_memory_advice(fraction, headroom)
        lines.append(
            f"fix: lower max_seq_len, {raise_fraction}lower max_num_tokens or max_batch_size "
            f"(activations and fixed state; profiled max_num_tokens={profile.max_num_tokens}), use a smaller "
            "kv_cache_dtype, " + ("capture fewer CUDA graphs (cuda_graph_batch_sizes, --no-cuda-graphs), " if profile.graph_bytes else "")
            + "or use more tensor_parallel_size"
        )
    return "\n  ".join(lines)


def _more_memory_advice(fraction: float, headroom: int | None) -> str:
    if headroom is not None:
        return "lower kv_headroom_bytes, " if headroom > 0 else ""
    return "raise free_gpu_memory_fraction, " if fraction < 1 else ""  # 1.0 is its maximum


__all__ = [
    "GIB", "CacheCost", "CapacityError", "CapacityPlan", "MemoryProfile",
    "cap_probe_tokens", "dummy_request_lengths", "dummy_workload_tokens", "estimation_tokens", "fmt_bytes",
    "kv_dtype_bytes", "kv_share", "memory_rule", "mha_cost", "mla_cost", "model_cost", "plan_capacity", "probe_cost",
]
