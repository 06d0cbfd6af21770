"""Capacity math: hand-computed examples, every CapacityError path, and split properties."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.capacity import (
    GIB,
    CacheCost,
    CapacityError,
    MemoryProfile,
    cap_probe_tokens,
    dummy_request_lengths,
    dummy_workload_tokens,
    estimation_tokens,
    kv_dtype_bytes,
    mha_cost,
    mla_cost,
    model_cost,
    plan_capacity,
    probe_cost,
)
from bootstrap.capacity.config_json import parse_config
from bootstrap.capacity.presets import preset_shape
from bootstrap.capacity.split import split_budgets, split_cross, split_draft

MIB = 1024**2


def profile(total=80 * GIB, peak=20 * GIB, probe=2 * GIB, model=16 * GIB, tokens=2048, non_torch=0) -> MemoryProfile:
    return MemoryProfile(
        total_bytes=total,
        free_before_bytes=total - model,
        model_bytes=model,
        torch_peak_bytes=peak - non_torch,
        torch_used_bytes=peak - non_torch,
        used_bytes=peak,
        probe_kv_bytes=probe,
        max_num_tokens=tokens,
    )


def plan(cost=CacheCost(131072), fraction=0.9, max_seq_len=4096, prof=None, **kw):
    return plan_capacity(
        prof or profile(),
        cost=cost,
        fraction=fraction,
        max_seq_len=max_seq_len,
        max_batch_size=8,
        tokens_per_block=32,
        **kw,
    )


# --- costs -----------------------------------------------------------------------------------


def test_llama_3_1_8b_bf16_costs_128_kib_per_token():
    # 2 (K,V) * 32 layers * 8 KV heads * 128 head_dim * 2 bytes
    cost = model_cost(preset_shape("llama-3.1-8b"), kv_dtype_bytes=2, tp=1, max_batch_size=8, tokens_per_block=32)
    assert cost == CacheCost(131072, 0)


def test_tensor_parallel_divides_kv_heads():
    shape = preset_shape("llama-3.1-8b")
    assert model_cost(shape, kv_dtype_bytes=2, tp=4, max_batch_size=1, tokens_per_block=32).slope == 131072 // 4
    # 8 KV heads on 16 ranks: each rank still holds one (replicated) head
    assert mha_cost(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2, tp=16).slope == 2 * 32 * 1 * 128 * 2


def test_tensor_parallel_must_divide_heads():
    with pytest.raises(CapacityError, match="tensor_parallel_size"):
        model_cost(preset_shape("llama-3.1-8b"), kv_dtype_bytes=2, tp=3, max_batch_size=1, tokens_per_block=32)


def test_mla_caches_latent_and_rope_only_without_tp_split():
    shape = preset_shape("deepseek-v2-lite")
    expected = 27 * (512 + 64) * 2
    assert mla_cost(layers=27, kv_lora_rank=512, rope_dim=64, dtype_bytes=2).slope == expected
    assert model_cost(shape, kv_dtype_bytes=2, tp=1, max_batch_size=4, tokens_per_block=64) == CacheCost(expected)
    assert model_cost(shape, kv_dtype_bytes=2, tp=2, max_batch_size=4, tokens_per_block=64).slope == expected


def test_gemma2_sliding_layers_go_to_the_intercept():
    cost = model_cost(preset_shape("gemma-2-9b"), kv_dtype_bytes=2, tp=1, max_batch_size=8, tokens_per_block=32)
    layer = 2 * 8 * 256 * 2  # bytes per token per layer
    assert cost.slope == 21 * layer  # 21 global layers
    assert cost.intercept == 8 * 21 * 4096 * layer  # 21 window layers x 4096 tokens x 8 sequences


def test_window_rounds_up_to_whole_blocks():
    base = preset_shape("gemma-2-9b")
    shape = dataclasses.replace(base, layer_windows=tuple(1000 if w else None for w in base.layer_windows))
    cost = model_cost(shape, kv_dtype_bytes=1, tp=1, max_batch_size=2, tokens_per_block=64)
    assert cost.intercept == 2 * 21 * 1024 * (2 * 8 * 256)  # ceil(1000 / 64) * 64 = 1024


def test_all_windowed_layers_are_priced_as_full_attention():
    base = preset_shape("mistral-7b")
    shape = dataclasses.replace(base, layer_windows=(4096,) * base.num_layers)
    assert model_cost(shape, kv_dtype_bytes=2, tp=1, max_batch_size=8, tokens_per_block=32) == CacheCost(131072)


def test_recurrent_state_goes_to_the_intercept():

    shape = parse_config(JAMBA_TINY)
    cost = model_cost(shape, kv_dtype_bytes=2, tp=1, max_batch_size=3, tokens_per_block=16)
    d_inner = 2 * 64
    state = d_inner * (4 - 1) + d_inner * 16
    assert cost.slope == 2 * 1 * 2 * 16 * 2  # one attention layer, 2 KV heads, head_dim 16
    assert cost.intercept == 3 * 7 * state * 2  # 7 Mamba layers


JAMBA_TINY = {
    "model_type": "jamba",
    "architectures": ["JambaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}


def test_kv_dtype_bytes():
    assert [kv_dtype_bytes(n) for n in ("float32", "bfloat16", "float16", "fp8")] == [4, 2, 2, 1]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_dtype_bytes("auto")


# --- probe size ------------------------------------------------------------------------------


def test_dummy_requests_split_max_num_tokens():
    assert dummy_request_lengths(8192, 3000) == [2999, 2999, 2194]
    assert dummy_request_lengths(2048, 8192) == [2048]
    assert sum(dummy_request_lengths(8192, 3000)) == 8192


def test_estimation_tokens_by_hand():
    # dummies [2999, 2999, 2194]: ceil(3000/32)=94, 94, ceil(2195/32)=69 -> 257 blocks
    assert estimation_tokens(max_num_tokens=8192, max_seq_len=3000, max_batch_size=8, tokens_per_block=32) == 257 * 32
    # one short dummy: the floor is one max_seq_len request + a block per other slot
    # ceil(8193/32)=257 + 63 = 320 blocks
    assert estimation_tokens(max_num_tokens=256, max_seq_len=8192, max_batch_size=64, tokens_per_block=32) == 320 * 32


# --- plan ------------------------------------------------------------------------------------


def test_plan_budget_by_hand():
    p = plan(prof=profile(non_torch=GIB))  # peak 20 GiB (1 GiB outside torch), probe 2 GiB back
    assert p.peak_bytes == 20 * GIB
    assert p.kv_budget_bytes == int(62 * GIB * 0.9)
    assert p.kv_tokens == p.kv_budget_bytes // 131072 // 32 * 32
    assert p.kv_requests == p.kv_tokens // 32 // 128 > 8
    assert p.max_concurrent_requests == 8  # the KV holds more, but a step runs max_batch_size at most
    assert p.limited_by == "memory"
    assert json.loads(json.dumps(p.to_dict()))["cost"] == {"slope": 131072, "intercept": 0}


def test_memory_profile_peak_counts_non_torch_memory():
    prof = MemoryProfile(
        total_bytes=100,
        free_before_bytes=90,
        model_bytes=10,
        torch_peak_bytes=40,
        torch_used_bytes=30,
        used_bytes=45,
        probe_kv_bytes=5,
        max_num_tokens=16,
    )
    assert prof.peak_bytes == 40 + 15
    assert prof.activation_bytes == 40 - 10 - 5


def test_caps_limit_the_budget():
    by_tokens = plan(max_kv_tokens=10_000)
    assert by_tokens.limited_by == "max_kv_tokens" and by_tokens.kv_budget_bytes == 10_000 * 131072
    assert by_tokens.kv_tokens == 10_000 // 32 * 32
    by_bytes = plan(max_kv_bytes=GIB, max_kv_tokens=10_000)
    assert by_bytes.limited_by == "max_kv_bytes" and by_bytes.kv_budget_bytes == GIB


def test_no_memory_left_names_the_knobs():
    with pytest.raises(CapacityError) as err:
        plan(prof=profile(peak=81 * GIB, probe=0))
    msg = str(err.value)
    assert "free_gpu_memory_fraction" in msg and "max_num_tokens" in msg and "tensor_parallel_size" in msg
    assert "GiB" in msg and "bytes" in msg


def test_budget_below_one_block_names_the_cap():
    with pytest.raises(CapacityError, match="max_kv_bytes"):
        plan(max_kv_bytes=131072 * 31)


def test_one_long_request_must_fit():
    with pytest.raises(CapacityError, match="max_seq_len") as err:
        plan(max_seq_len=1_000_000)
    assert "lower max_seq_len" in str(err.value)


def test_fraction_out_of_range():
    with pytest.raises(CapacityError, match="free_gpu_memory_fraction"):
        plan(fraction=0.0)


# --- splits: examples ------------------------------------------------------------------------


def test_draft_split_by_hand():
    # var = 1000 - 15 = 985; draft = 5 + 985 * 50 // 150 = 5 + 328
    assert split_draft(1000, CacheCost(100, 10), CacheCost(50, 5)) == (667, 333)
    assert split_draft(1000, CacheCost(100, 10), CacheCost(50, 5), on_gpu=False) == (667, 333)
    assert split_draft(12, CacheCost(100, 10), CacheCost(50, 5), on_gpu=False) == (8, 4)


def test_draft_split_without_room_for_intercepts():
    with pytest.raises(CapacityError, match="max_batch_size"):
        split_draft(14, CacheCost(100, 10), CacheCost(50, 5))
    assert split_draft(0, CacheCost(100, 10), CacheCost(50, 5), on_gpu=False) == (0, 0)


def test_cross_split():
    assert split_cross(1000, 0.25) == (750, 250)
    with pytest.raises(CapacityError, match="cross_kv_cache_fraction"):
        split_cross(1000, 1.0)


def test_split_budgets_cross_then_draft():
    target, draft, cross = CacheCost(131072), CacheCost(32768), CacheCost(65536)
    p = plan(cost=target + draft + cross)
    pools = split_budgets(
        p, target_cost=target, draft_cost=draft, cross_cost=cross, cross_fraction=0.2, host_bytes=10 * GIB
    )
    assert pools.cross.gpu_bytes == int(p.kv_budget_bytes * 0.2)
    self_bytes = p.kv_budget_bytes - pools.cross.gpu_bytes
    assert pools.draft.gpu_bytes == self_bytes * 32768 // (131072 + 32768)
    assert sum(x.gpu_bytes for x in pools.pools()) == p.kv_budget_bytes
    assert sum(x.host_bytes for x in pools.pools()) == 10 * GIB
    assert [x.name for x in pools.pools()] == ["target", "draft", "cross"]
    assert set(pools.to_dict()) == {"target", "draft", "cross"}


def test_split_budgets_errors_name_the_knob():
    p = plan(cost=CacheCost(131072) + CacheCost(1000))
    with pytest.raises(CapacityError, match="cross_kv_cache_fraction"):
        split_budgets(p, target_cost=CacheCost(131072), cross_cost=CacheCost(1000))
    with pytest.raises(CapacityError, match="cross_kv_cache_fraction"):
        split_budgets(plan(), target_cost=CacheCost(131072), cross_fraction=0.5)
    with pytest.raises(ValueError, match="sized for"):
        split_budgets(plan(), target_cost=CacheCost(1))
    tight = plan(cost=CacheCost(131072) + CacheCost(1000), max_seq_len=4096, max_kv_tokens=4096)
    with pytest.raises(CapacityError, match="cross_kv_cache_fraction"):
        split_budgets(tight, target_cost=CacheCost(131072), cross_cost=CacheCost(1000), cross_fraction=0.5)


# --- properties ------------------------------------------------------------------------------

costs = st.builds(CacheCost, st.integers(1, 10**7), st.integers(0, 10**10))
budgets = st.integers(0, 2**45)


@given(costs, st.integers(0, 10**8))
def test_tokens_bytes_round_trip(cost, tokens):
    assert cost.tokens_for_budget(cost.bytes_for_tokens(tokens)) == tokens


@given(costs, budgets)
def test_tokens_for_budget_never_overspends(cost, budget):
    tokens = cost.tokens_for_budget(budget)
    assert tokens >= 0
    if tokens:
        assert cost.bytes_for_tokens(tokens) <= budget < cost.bytes_for_tokens(tokens + 1)


@given(costs, costs, budgets, st.booleans())
def test_draft_split_conserves_and_is_non_negative(target, draft, budget, on_gpu):
    try:
        t, d = split_draft(budget, target, draft, on_gpu=on_gpu)
    except CapacityError:
        assert on_gpu and budget <= target.intercept + draft.intercept
        return
    assert t + d == budget and t >= 0 and d >= 0
    if on_gpu:
        assert t >= target.intercept and d >= draft.intercept


@given(costs, costs, budgets, st.integers(1, 2**30), st.booleans())
def test_draft_split_is_monotonic_in_budget(target, draft, budget, extra, on_gpu):
    floor = target.intercept + draft.intercept + 1 if on_gpu else 0
    low = split_draft(max(budget, floor), target, draft, on_gpu=on_gpu)
    high = split_draft(max(budget, floor) + extra, target, draft, on_gpu=on_gpu)
    assert high[0] >= low[0] and high[1] >= low[1]


@given(budgets, st.floats(0.001, 0.999), st.integers(1, 2**30))
def test_cross_split_conserves_and_is_monotonic(budget, fraction, extra):
    s, c = split_cross(budget, fraction)
    s2, c2 = split_cross(budget + extra, fraction)
    assert s + c == budget and s >= 0 and c >= 0
    assert s2 >= s and c2 >= c


@settings(max_examples=60)
@given(
    st.integers(4 * 1024, 64 * 1024),
    st.integers(1, 4 * 1024),
    st.integers(1, 4 * 1024),
    st.sampled_from([16, 32, 64]),
    st.integers(0, 10**9),
)
def test_pool_tokens_are_block_aligned(t_slope, d_slope, x_slope, tpb, host):
    target, draft, cross = CacheCost(t_slope), CacheCost(d_slope), CacheCost(x_slope)
    total = target + draft + cross
    p = plan_capacity(profile(), cost=total, fraction=0.5, max_seq_len=512, max_batch_size=4, tokens_per_block=tpb)
    assert p.kv_tokens % tpb == 0
    pools = split_budgets(
        p, target_cost=target, draft_cost=draft, cross_cost=cross, cross_fraction=0.3, host_bytes=host
    )
    assert sum(x.gpu_bytes for x in pools.pools()) == p.kv_budget_bytes
    assert sum(x.host_bytes for x in pools.pools()) == host
    for pool in pools.pools():
        assert pool.tokens % tpb == 0 and pool.tokens >= 512
        assert pool.cost.bytes_for_tokens(pool.tokens) <= pool.gpu_bytes


@settings(max_examples=60)
@given(st.integers(1, 80 * GIB), st.integers(0, 4 * GIB), st.floats(0.05, 1.0))
def test_plan_is_monotonic_in_free_memory(peak, probe, fraction):
    cost = CacheCost(131072)
    results = []
    for total in (81 * GIB, 100 * GIB):
        try:
            results.append(plan(cost=cost, fraction=fraction, prof=profile(total=total, peak=peak, probe=probe)))
        except CapacityError:
            results.append(None)
    low, high = results
    if low is not None:
        assert high is not None and high.kv_tokens >= low.kv_tokens


def test_probe_is_capped_to_what_the_free_memory_fraction_holds():
    cost = CacheCost(slope=1000)
    # 10 blocks of 32 wanted; 0.5 x 200,000 free bytes hold 100 tokens = 3 whole blocks
    assert cap_probe_tokens(320, cost=cost, free_bytes=200_000, fraction=0.5, tokens_per_block=32) == 96
    assert cap_probe_tokens(320, cost=cost, free_bytes=10**9, fraction=0.9, tokens_per_block=32) == 320
    assert cap_probe_tokens(300, cost=cost, free_bytes=10**9, fraction=0.9, tokens_per_block=32) == 320  # aligned up
    with pytest.raises(CapacityError, match="lower max_batch_size"):  # not one block fits: no retry can help
        cap_probe_tokens(320, cost=CacheCost(1000, 10**6), free_bytes=10**6, fraction=0.9, tokens_per_block=32)


def test_windows_at_least_max_seq_len_are_priced_as_full_attention():
    gemma = preset_shape("gemma-2-9b")  # 42 layers, every other one with a 4096-token window
    layer = 2 * 8 * 256 * 2  # 8 KV heads x 256 head_dim, bf16
    short = model_cost(gemma, kv_dtype_bytes=2, tp=1, max_batch_size=32, tokens_per_block=32, max_seq_len=512)
    assert short == CacheCost(slope=42 * layer, intercept=0)  # a 4096 window never slides in 512 tokens
    long = model_cost(gemma, kv_dtype_bytes=2, tp=1, max_batch_size=32, tokens_per_block=32, max_seq_len=8192)
    assert long == CacheCost(slope=21 * layer, intercept=32 * 21 * 4096 * layer)


def test_dummy_workload_is_the_estimate_without_its_warm_up_floor():
    # 8192 tokens at max_seq_len 8192: dummies of 8191 and 1 tokens, each + 1 generated: 256 + 1 blocks
    assert dummy_workload_tokens(max_num_tokens=8192, max_seq_len=8192, tokens_per_block=32) == 257 * 32
    # the estimate adds the floor of one max_seq_len request plus a block per other batch slot
    assert estimation_tokens(max_num_tokens=8192, max_seq_len=8192, max_batch_size=64, tokens_per_block=32) == 320 * 32
    assert dummy_workload_tokens(max_num_tokens=2048, max_seq_len=131072, tokens_per_block=32) == 65 * 32


def test_probe_is_capped_by_max_kv_tokens_floored_to_a_block_and_never_below_one():
    cost = CacheCost(slope=1000)
    free = 10**9
    assert cap_probe_tokens(320, cost=cost, free_bytes=free, fraction=0.9, tokens_per_block=32, max_kv_tokens=100) == 96
    assert cap_probe_tokens(320, cost=cost, free_bytes=free, fraction=0.9, tokens_per_block=32, max_kv_tokens=5) == 32
    assert (
        cap_probe_tokens(320, cost=cost, free_bytes=free, fraction=0.9, tokens_per_block=32, max_kv_tokens=10**6) == 320
    )


def test_probe_room_is_the_fraction_of_free_memory_left_beside_the_overhead_and_max_kv_bytes():
    cost = CacheCost(slope=1000)
    # 0.5 x (400,000 - 200,000) holds 100 tokens = 3 blocks; without the overhead it would be 6
    assert cap_probe_tokens(320, cost=cost, free_bytes=400_000, fraction=0.5, tokens_per_block=32) == 192
    assert (
        cap_probe_tokens(320, cost=cost, free_bytes=400_000, fraction=0.5, tokens_per_block=32, overhead_bytes=200_000)
        == 96
    )
    assert (
        cap_probe_tokens(320, cost=cost, free_bytes=10**9, fraction=0.9, tokens_per_block=32, max_kv_bytes=64_000) == 64
    )
    with pytest.raises(CapacityError, match="max_kv_bytes") as info:
        cap_probe_tokens(320, cost=cost, free_bytes=10**9, fraction=0.9, tokens_per_block=32, max_kv_bytes=31_999)
    assert "limited by max_kv_bytes" in str(info.value)


def test_executor_state_beyond_free_memory_names_max_batch_size():
    with pytest.raises(CapacityError, match="temporary executor's state") as info:
        cap_probe_tokens(
            320, cost=CacheCost(1000), free_bytes=10**6, fraction=0.9, tokens_per_block=32, overhead_bytes=2 * 10**6
        )
    assert "lower max_batch_size" in str(info.value)


def test_fixed_state_of_the_final_pools_beyond_the_room_fails_before_any_probe():
    """The probe carries no window state, but the plan does: when its one block cannot fit in the
    room (the most the final budget can be), no plan exists."""
    probe, plan_cost = CacheCost(1000), CacheCost(1000, 10**6)
    assert cap_probe_tokens(320, cost=probe, free_bytes=10**6, fraction=0.9, tokens_per_block=32) == 320
    with pytest.raises(CapacityError, match="sliding-window or recurrent state"):
        cap_probe_tokens(320, cost=probe, free_bytes=10**6, fraction=0.9, tokens_per_block=32, plan_cost=plan_cost)


def test_the_probe_prices_every_layer_at_full_length_and_keeps_recurrent_state():
    gemma = preset_shape("gemma-2-9b")  # 42 layers, 21 of them with a 4096-token window
    layer = 2 * 8 * 256 * 2
    assert probe_cost([gemma], kv_dtype_bytes=2, tp=1, max_batch_size=32) == CacheCost(slope=42 * layer)
    llama = preset_shape("llama-3.1-8b")
    plan_cost = model_cost(llama, kv_dtype_bytes=2, tp=1, max_batch_size=32, tokens_per_block=32)
    assert probe_cost([llama, None], kv_dtype_bytes=2, tp=1, max_batch_size=32) == plan_cost  # no windows: equal
    both = probe_cost([llama, llama], kv_dtype_bytes=2, tp=1, max_batch_size=32)
    assert both == plan_cost + plan_cost  # target and draft probes add up

    jamba = parse_config(JAMBA_TINY)  # recurrent state is per sequence slot, probe or not
    assert probe_cost([jamba], kv_dtype_bytes=2, tp=1, max_batch_size=3) == model_cost(
        jamba, kv_dtype_bytes=2, tp=1, max_batch_size=3, tokens_per_block=16
    )


# --- kv_headroom_bytes: all but a fixed headroom instead of a fraction ----------------------------


def test_headroom_budget_is_everything_left_but_the_headroom():
    # total 80 GiB, peak 20 GiB, probe 2 GiB added back: 62 GiB left after the peak
    p = plan(headroom_bytes=3 * GIB)
    assert p.kv_budget_bytes == 59 * GIB and p.headroom_bytes == 3 * GIB and p.limited_by == "memory"
    assert plan().kv_budget_bytes == int(62 * GIB * 0.9) and plan().headroom_bytes is None
    assert plan(headroom_bytes=0).kv_budget_bytes == 62 * GIB


def test_headroom_is_capped_by_explicit_limits_like_the_fraction():
    assert plan(headroom_bytes=GIB, max_kv_bytes=10 * GIB).limited_by == "max_kv_bytes"
    assert plan(headroom_bytes=GIB, max_kv_tokens=8192).kv_budget_bytes == 8192 * 131072


def test_a_headroom_larger_than_what_is_left_names_it():
    with pytest.raises(CapacityError) as info:
        plan(headroom_bytes=62 * GIB)
    assert "kv_headroom_bytes" in str(info.value) and "lower kv_headroom_bytes" in str(info.value)
    with pytest.raises(CapacityError, match="kv_headroom_bytes must be >= 0"):
        plan(headroom_bytes=-1)


def test_probe_room_with_a_headroom_is_free_memory_less_the_headroom():
    cost = CacheCost(1000)
    tokens = cap_probe_tokens(
        10**9,
        cost=cost,
        free_bytes=10**8,
        fraction=0.9,
        tokens_per_block=10,
        overhead_bytes=10**6,
        headroom_bytes=9 * 10**6,
    )
    assert tokens == (10**8 - 10**6 - 9 * 10**6) // 1000
    with pytest.raises(CapacityError, match="limited by kv_headroom_bytes 99,995,000"):  # room for 5 tokens
        cap_probe_tokens(
            10**9, cost=cost, free_bytes=10**8, fraction=0.9, tokens_per_block=10, headroom_bytes=10**8 - 5_000
        )


def test_a_max_seq_len_that_is_not_a_multiple_of_the_block_size_takes_its_last_block_whole():
    """max_seq_len 1000 in blocks of 32: 32 blocks a request (1024 tokens), not 31 (992, too few)."""
    short = plan(max_seq_len=1000, max_kv_tokens=95 * 32)  # 95 blocks: 2 requests of 32 blocks, not 3 of 31
    assert (short.kv_tokens, short.kv_requests, short.max_concurrent_requests) == (3040, 2, 2)
    assert plan(max_seq_len=1000, max_kv_tokens=96 * 32).kv_requests == 3
    with pytest.raises(CapacityError, match=r"one request of max_seq_len=1000 \(32 blocks\)"):
        plan(max_seq_len=1000, max_kv_tokens=31 * 32)  # 992 tokens hold 31 blocks, one short of a request
