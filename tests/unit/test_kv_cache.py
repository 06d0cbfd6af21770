"""The paged KV cache: sizing, block tables, slots, accounting, release, input checks."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from transformers import LlamaConfig

from bootstrap.engine.kv_cache import KVCacheFull, KVCacheSpec, PagedKVCache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # K and V, layers, kv heads, head dim, float32


def test_bytes_per_token_formula():
    assert PagedKVCache.bytes_per_token(2, 2, 8, torch.float32) == BYTES_PER_TOKEN
    assert PagedKVCache.bytes_per_token(32, 8, 128, torch.bfloat16) == 2 * 32 * 8 * 128 * 2
    assert SPEC.bytes_per_token == BYTES_PER_TOKEN


def test_spec_from_config_handles_gqa_and_default_head_dim():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    spec = KVCacheSpec.from_config(config, torch.float16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (3, 2, 16, torch.float16)


def test_spec_from_config_rejects_latent_attention():
    from transformers import DeepseekV2Config

    with pytest.raises(ValueError, match="multi-head latent attention"):
        KVCacheSpec.from_config(DeepseekV2Config(kv_lora_rank=64), torch.bfloat16)


def test_from_tokens_rounds_up_to_whole_blocks():
    cache = PagedKVCache.from_tokens(SPEC, 10, 4, "cpu")
    assert cache.num_blocks == 3
    stats = cache.stats()
    assert stats.total_blocks == 3 and stats.capacity_tokens == 12
    assert stats.total_bytes == 12 * BYTES_PER_TOKEN


def test_from_bytes_takes_whole_blocks_within_budget():
    block = 4 * BYTES_PER_TOKEN
    cache = PagedKVCache.from_bytes(SPEC, 5 * block + block - 1, 4, "cpu")
    assert cache.num_blocks == 5
    assert cache.stats().total_bytes <= 6 * block - 1
    tensor_bytes = cache.k_cache(0).numel() * cache.k_cache(0).element_size() * 2 * SPEC.num_layers
    assert tensor_bytes == cache.stats().total_bytes


def test_from_bytes_below_one_block_is_a_clear_error():
    with pytest.raises(ValueError, match="below one block"):
        PagedKVCache.from_bytes(SPEC, 4 * BYTES_PER_TOKEN - 1, 4, "cpu")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_blocks=0, tokens_per_block=4), "num_blocks"),
        (dict(num_blocks=2, tokens_per_block=0), "tokens_per_block"),
        (dict(num_blocks=2.5, tokens_per_block=4), "num_blocks"),
    ],
)
def test_bad_sizes_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PagedKVCache(SPEC, device="cpu", **kwargs)


def test_bad_spec_names_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVCacheSpec(2, 0, 8, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        KVCacheSpec(2, 2, 8, torch.int64)


def test_allocate_extend_free_accounting():
    cache = PagedKVCache(SPEC, num_blocks=8, tokens_per_block=4, device="cpu")
    assert len(cache.allocate("a", 5)) == 2
    assert len(cache.extend("a", 3)) == 2  # 8 tokens still fit in 2 blocks
    assert len(cache.extend("a", 1)) == 3
    cache.allocate("b", 0)
    assert cache.block_table("b") == []
    cache.extend("b", 1)
    stats = cache.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.used_tokens) == (4, 4, 10)
    assert stats.allocated_bytes == 4 * 4 * BYTES_PER_TOKEN
    assert stats.used_bytes == 10 * BYTES_PER_TOKEN
    assert not set(cache.block_table("a")) & set(cache.block_table("b"))
    cache.free("a")
    cache.free("a")  # idempotent
    assert cache.stats().free_blocks == 7
    cache.free("b")
    assert cache.stats().used_blocks == 0 and cache.stats().free_blocks == 8


def test_running_out_of_blocks_raises_with_figures_and_keeps_state():
    cache = PagedKVCache(SPEC, num_blocks=2, tokens_per_block=4, device="cpu")
    cache.allocate("a", 8)
    with pytest.raises(KVCacheFull, match="needs 1 more KV blocks but only 0 of 2"):
        cache.extend("a", 1)
    assert cache.num_tokens("a") == 8
    assert not cache.can_allocate(1)
    with pytest.raises(KVCacheFull):
        cache.allocate("b", 1)
    assert not cache.holds("b")


def test_double_allocate_and_unknown_request_are_errors():
    cache = PagedKVCache(SPEC, num_blocks=4, tokens_per_block=4, device="cpu")
    cache.allocate(1, 2)
    with pytest.raises(ValueError, match="already holds"):
        cache.allocate(1, 2)
    with pytest.raises(KeyError, match="holds no KV blocks"):
        cache.extend(2, 1)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.extend(1, -1)


def test_slots_follow_the_block_table():
    cache = PagedKVCache(SPEC, num_blocks=6, tokens_per_block=4, device="cpu")
    cache.allocate("x", 3)  # takes block 0
    cache.allocate("y", 6)  # takes blocks 1, 2
    cache.free("x")
    cache.extend("y", 4)  # block 3 (free list is FIFO; block 0 went to its back)
    table = cache.block_table("y")
    expected = [table[p // 4] * 4 + p % 4 for p in range(2, 10)]
    assert cache.slots("y", 2, 10).tolist() == expected
    with pytest.raises(ValueError, match="out of range"):
        cache.slots("y", 0, 11)


def test_layer_views_write_into_the_pool():
    cache = PagedKVCache(SPEC, num_blocks=2, tokens_per_block=4, device="cpu")
    assert cache.k_cache(1).shape == (2, 4, 2, 8)
    cache.v_cache(1)[1, 2].fill_(3.0)
    assert cache.v_cache(1)[1, 2].sum() == 3.0 * 16
    assert cache.k_cache(1).abs().sum() == 0 and cache.v_cache(0).abs().sum() == 0


def test_release_frees_tensors_and_is_idempotent():
    cache = PagedKVCache(SPEC, num_blocks=4, tokens_per_block=4, device="cpu")
    cache.allocate("a", 5)
    cache.release()
    cache.release()
    assert cache.released
    assert cache.stats().total_bytes == 0 and cache.stats().used_blocks == 0
    with pytest.raises(RuntimeError, match="released"):
        cache.k_cache(0)
    with pytest.raises(RuntimeError, match="released"):
        cache.allocate("b", 1)


def test_separate_pools_are_independent():
    target = PagedKVCache(SPEC, num_blocks=4, tokens_per_block=4, device="cpu")
    draft = PagedKVCache(KVCacheSpec(1, 1, 8, torch.float32), num_blocks=4, tokens_per_block=4, device="cpu")
    target.allocate(7, 16)
    assert draft.can_allocate(16) and not target.can_allocate(1)
    draft.allocate(7, 4)
    target.free(7)
    assert draft.num_tokens(7) == 4 and target.stats().used_blocks == 0


def test_stats_from_another_thread_while_requests_come_and_go():
    """A monitor thread reads stats() while the engine thread allocates and frees."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    cache = PagedKVCache(KVCacheSpec(1, 1, 4, torch.float32), 4096, 1, "cpu")
    done = threading.Event()

    def churn() -> None:
        i = 0
        while not done.is_set():
            cache.allocate(i, 1)
            cache.free(i - 2000)
            i += 1

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        readings = [cache.stats() for _ in range(3000)]
    finally:
        done.set()
        worker.join()
        sys.setswitchinterval(previous)
    assert all(s.used_blocks + s.free_blocks == s.total_blocks for s in readings)
    assert all(s.used_tokens == s.used_blocks for s in readings)  # one token per block here


def test_truncate_rolls_back_rejected_tokens_and_returns_their_blocks():
    cache = PagedKVCache(SPEC, num_blocks=8, tokens_per_block=4, device="cpu")
    cache.allocate("r", 10)  # 3 blocks
    cache.extend("r", 5)  # a speculative step's 5 tokens: 15 tokens, 4 blocks
    assert cache.num_free_blocks == 4
    kept = list(cache.truncate("r", 11))  # 1 of them accepted
    assert cache.num_tokens("r") == 11 and len(kept) == 3 and cache.num_free_blocks == 5
    assert cache.stats().used_tokens == 11
    cache.extend("r", 1)  # the next token goes where the rolled back ones were
    assert cache.block_table("r") == kept and cache.num_tokens("r") == 12
    for bad in (13, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"num_tokens must be an integer in \[0, 12\]"):
            cache.truncate("r", bad)
    cache.truncate("r", 0)
    assert cache.block_table("r") == [] and cache.num_free_blocks == 8


def test_truncate_never_leaves_a_request_writing_into_a_shared_block():
    cache = PagedKVCache(SPEC, num_blocks=8, tokens_per_block=4, device="cpu")
    cache.allocate("parent", 8)  # two full blocks, then shared with the fork
    cache.fork("parent", "child")
    cache.extend("child", 3)
    cache.truncate("child", 8)  # back to the fork point, a block boundary: fine
    assert cache.shared_blocks() == 2 and cache.num_free_blocks == 6
    with pytest.raises(ValueError, match=r"inside block .* which another request shares"):
        cache.truncate("child", 6)
    assert cache.num_tokens("child") == 8  # refused: nothing changed
    cache.free("child")
    cache.truncate("parent", 6)  # nobody else holds it now
    assert cache.num_free_blocks == 6 and cache.shared_blocks() == 0
