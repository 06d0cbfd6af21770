"""What ranks agree on after ``profiling`` and ``capacity`` (a stage's ``agree`` function):
the most conservative profile and the smallest plan, so every rank sizes the same pool and
each one has room for it."""

from __future__ import annotations

from bootstrap.capacity.plan import CapacityPlan, MemoryProfile

LARGEST = ("model_bytes", "torch_peak_bytes", "used_bytes")  # more of these: less room for KV
SMALLEST = ("total_bytes", "free_before_bytes", "torch_used_bytes", "probe_kv_bytes", "max_num_tokens")


def conservative_profile(profiles: list[MemoryProfile]) -> MemoryProfile:
    """Field by field, the value that leaves the least room for the KV cache: the largest
    weights, torch peak and used memory; the smallest total and free memory, torch-held memory
    (so the non-torch share ``used - torch_used`` is the largest), probe pool (added back to the
    budget) and ``max_num_tokens``. Every rank's budget from it is at most its own."""
    values = {name: max(getattr(p, name) for p in profiles) for name in LARGEST}
    values |= {name: min(getattr(p, name) for p in profiles) for name in SMALLEST}
    return MemoryProfile(**values)


def smallest_plan(plans: list[CapacityPlan]) -> CapacityPlan:
    """The plan of the smallest KV budget (the lowest rank's among equals): every rank sizes
    its pool for the same token capacity, and each one has room for it."""
    return min(plans, key=lambda p: p.kv_budget_bytes)
