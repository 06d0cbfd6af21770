"""The probe: the profiling dummies' lengths, the KV tokens they need, and the probe size the
room allows (reference §3.1)."""

from __future__ import annotations

from bootstrap.capacity.cost import CacheCost
from bootstrap.capacity.errors import CapacityError, check_positive, fmt_bytes
from bootstrap.capacity.rules import kv_share, memory_rule


def dummy_request_lengths(max_num_tokens: int, max_seq_len: int) -> list[int]:
    """Prompt lengths of the profiling dummies: ``max_num_tokens`` cut into requests of
    ``min(max_num_tokens, max_seq_len - 1)`` tokens, the remainder last (reference §3.1)."""
    check_positive(max_num_tokens=max_num_tokens)
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    length = min(max_num_tokens, max_seq_len - 1)
    full, rest = divmod(max_num_tokens, length)
    return [length] * full + ([rest] if rest else [])


def dummy_workload_tokens(*, max_num_tokens: int, max_seq_len: int, tokens_per_block: int) -> int:
    """KV tokens the profiling dummies occupy at once: ``sum(ceil((len + 1) / tpb)) * tpb`` over
    ``dummy_request_lengths`` (one generated token each). The smallest probe that runs the dummy
    workload of ``max_num_tokens`` in one step."""
    check_positive(tokens_per_block=tokens_per_block)
    lengths = dummy_request_lengths(max_num_tokens, max_seq_len)
    return sum(-(-(n + 1) // tokens_per_block) for n in lengths) * tokens_per_block


def estimation_tokens(*, max_num_tokens: int, max_seq_len: int, max_batch_size: int, tokens_per_block: int) -> int:
    """Probe KV capacity in tokens (reference §3.1, one pool group, beam width 1).

    The dummy workload (``dummy_workload_tokens``), but at least one full ``max_seq_len`` request
    plus one block for each other batch slot (TensorRT-LLM's CUDA-graph warm-up floor). Block aligned.
    """
    check_positive(max_batch_size=max_batch_size, tokens_per_block=tokens_per_block)
    workload = dummy_workload_tokens(
        max_num_tokens=max_num_tokens, max_seq_len=max_seq_len, tokens_per_block=tokens_per_block
    )
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
    check_positive(tokens=tokens, tokens_per_block=tokens_per_block)
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
