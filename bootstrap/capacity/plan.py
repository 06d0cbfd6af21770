"""From a measured ``MemoryProfile`` to a ``CapacityPlan``: the KV byte budget and token capacity
(reference §3.2), with the caps and the figures of every infeasible case."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from bootstrap.capacity.cost import CacheCost
from bootstrap.capacity.errors import CapacityError, check_positive, fmt_bytes
from bootstrap.capacity.rules import kv_share, memory_rule
from bootstrap.config import is_int


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiling run measured, in bytes (``used_bytes`` = total - free after the run).

    ``model_bytes`` is what torch held before the dummy forward *less the probe KV pool*:
    weights plus the probe executor's state. ``probe_kv_bytes`` is counted separately, so every
    backend must measure ``model_bytes`` this way for ``activation_bytes`` to be the forward's.

    ``graph_bytes``: device memory the decode CUDA graphs of the ``warmup`` stage take (their
    memory pool, static outputs and the driver's graph objects), from the probe after the dummy
    forward: the native backend estimates it from one eager decode step of the largest bucket
    (``engine.step.graphs.capture_reserve_bytes``); 0 where nothing is captured. It is not part of
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
            if not is_int(value) or value < 0:
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
    headroom_bytes: int | None = None  # a headroom rule: replaces the fraction when set
    rule_source: str = ""  # which memory rule, and why (``MemoryRule.source``, ``bootstrap.capacity.rules``)
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
    rule_source: str = "",
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
    check_positive(max_seq_len=max_seq_len, max_batch_size=max_batch_size, tokens_per_block=tokens_per_block)
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
        total_bytes=profile.total_bytes,
        peak_bytes=profile.peak_bytes,
        kv_budget_bytes=budget,
        kv_tokens=kv_tokens,
        cost=cost,
        tokens_per_block=tokens_per_block,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        max_num_tokens=profile.max_num_tokens,
        max_concurrent_requests=min(kv_requests, max_batch_size),
        kv_requests=kv_requests,
        limited_by=limited_by,
        fraction=fraction,
        headroom_bytes=headroom_bytes,
        rule_source=rule_source,
        graph_bytes=profile.graph_bytes,
    )


def _capped_budget(
    profile: MemoryProfile,
    cost: CacheCost,
    fraction: float,
    max_kv_bytes: int | None,
    max_kv_tokens: int | None,
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
    profile: MemoryProfile,
    cost: CacheCost,
    share: tuple[float, int | None],
    budget: int,
    limited_by: str,
    tokens: int,
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
            "kv_cache_dtype, "
            + ("capture fewer CUDA graphs (cuda_graph_batch_sizes, --no-cuda-graphs), " if profile.graph_bytes else "")
            + "or use more tensor_parallel_size"
        )
    return "\n  ".join(lines)


def _more_memory_advice(fraction: float, headroom: int | None) -> str:
    if headroom is not None:
        return "lower kv_headroom_bytes, " if headroom > 0 else ""
    return "raise free_gpu_memory_fraction, " if fraction < 1 else ""  # 1.0 is its maximum
