"""The KV pool's prefix cache (``PagedKVCache.match`` / ``publish`` / ``allocate(prefix=)``) and
the chained block digests (``prefix_hash``): a published block is found again by its digest,
shared, cached when nobody holds it, handed out again least recently released first and only
when no plain free block is left, and forgotten by ``clear_cache``; every block is accounted for
after random operations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.engine.kv_cache import KVCacheFull, KVCacheSpec, PagedKVCache
from bootstrap.engine.request.prefix_hash import extend_hashes

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
TPB = 4


def pool(blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(SPEC, num_blocks=blocks, tokens_per_block=TPB, device="cpu")


def digests(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return extend_hashes([], tokens, TPB, salt)


def test_digests_chain_every_earlier_token_and_the_salt():
    a = digests(list(range(12)))
    assert len(a) == 3 and len(set(a)) == 3
    assert digests(list(range(13))) == a  # a partial block has none
    changed = digests([99, *range(1, 12)])  # the first token differs: every later block too
    assert all(x != y for x, y in zip(a, changed))
    assert digests([*range(8), 0, 0, 0, 0])[:2] == a[:2]  # same prefix, same first digests
    assert digests(list(range(12)), salt="tenant-a") != a
    assert digests(list(range(12)), salt="tenant-a") != digests(list(range(12)), salt="tenant-b")
    assert digests(list(range(12)), salt="") != a  # an empty salt is a salt
    assert extend_hashes(a[:1], list(range(12)), TPB, None) == a  # extended, not recomputed


def test_a_published_prefix_is_found_shared_and_cached_after_its_holder_ends():
    cache = pool()
    prompt = digests(list(range(12)))
    cache.allocate("a", 14)  # 3 full blocks and a partial one
    assert cache.publish("a", prompt) == 3
    assert cache.match(prompt) == cache.block_table("a")[:3]
    assert cache.match([prompt[0], b"unknown", prompt[2]]) == cache.block_table("a")[:1]  # a run from the start

    table = cache.allocate("b", 13, prefix=cache.match(prompt))
    assert table[:3] == cache.block_table("a")[:3] and cache.shared_blocks() == 3
    assert cache.stats().used_blocks == 5 and cache.num_free_blocks == 3

    cache.free("a")
    cache.free("b")
    stats = cache.stats()
    assert (stats.used_blocks, stats.free_blocks, stats.cached_blocks, stats.cached_free_blocks) == (0, 8, 3, 3)
    assert len(cache.match(prompt)) == 3  # cached, nobody holding it


def test_cached_blocks_go_last_and_oldest_first_and_forget_their_digest():
    cache = pool(4)
    first, second = digests([1] * 4), digests([2] * 4)
    cache.allocate("a", 4)
    cache.publish("a", first)
    cache.free("a")
    cache.allocate("b", 4)
    cache.publish("b", second)
    cache.free("b")
    assert cache.stats().cached_free_blocks == 2
    cache.allocate("c", 8)  # the two plain free blocks first
    assert cache.match(first) and cache.match(second)
    cache.extend("c", 4)  # then the cached block released longest ago
    assert cache.match(first) == [] and len(cache.match(second)) == 1
    cache.extend("c", 4)
    assert cache.match(second) == [] and cache.stats().cached_blocks == 0
    with pytest.raises(KVCacheFull):
        cache.extend("c", 1)


def test_a_cached_prefix_held_again_is_not_free_twice():
    cache = pool(2)
    cache.allocate("a", 4)
    prompt = digests([5] * 4)
    cache.publish("a", prompt)
    cache.free("a")  # 1 plain free + 1 cached = 2 free
    with pytest.raises(KVCacheFull):  # holding the cached one leaves a single block for 2 more
        cache.allocate("b", 12, prefix=cache.match(prompt))
    assert cache.stats().used_blocks == 0 and cache.num_free_blocks == 2  # refused: nothing changed
    cache.allocate("b", 8, prefix=cache.match(prompt))
    assert cache.num_free_blocks == 0


def test_publish_keeps_the_first_block_of_a_digest_and_checks_the_request_holds_it():
    cache = pool()
    prompt = digests([3] * 8)
    cache.allocate("a", 8)
    cache.allocate("b", 8)  # the same tokens, computed twice before either was published
    assert cache.publish("a", prompt) == 2
    assert cache.publish("b", prompt) == 0
    assert cache.match(prompt) == cache.block_table("a")
    cache.free("b")
    assert cache.stats().cached_free_blocks == 0  # b's copies were never registered: plain free
    with pytest.raises(ValueError, match="fewer than 3 full blocks"):
        cache.publish("a", digests([3] * 12))
    with pytest.raises(ValueError, match="not cached"):
        cache.allocate("c", 4, prefix=[next(b for b in range(8) if b not in cache.block_table("a"))])
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 8"):
        cache.allocate("c", 7, prefix=cache.match(prompt))


def test_clear_cache_and_release_forget_every_digest():
    cache = pool()
    prompt = digests([4] * 8)
    cache.allocate("a", 8)
    cache.publish("a", prompt)
    cache.allocate("b", 8, prefix=cache.match(prompt[:1]))
    cache.free("a")
    cache.clear_cache()
    assert cache.match(prompt) == [] and cache.stats().cached_blocks == 0
    assert cache.num_free_blocks == 6  # b still holds the block it shares and one of its own
    cache.free("b")
    assert cache.num_free_blocks == 8 and cache.stats().cached_free_blocks == 0
    cache.allocate("c", 8)
    cache.publish("c", prompt)
    cache.release()
    assert cache.match(prompt) == [] and cache.stats().cached_blocks == 0


OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["start", "grow", "publish", "free", "fork", "cut", "clear"]), st.integers(0, 5)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPERATIONS)
def test_every_block_is_accounted_for_after_random_operations(operations):
    """Held, cached-free and plain free blocks partition the pool; each block's holders equal
    the tables naming it; what ``match`` returns is registered; freeing every request leaves
    every block free."""
    cache = pool(12)
    tokens: dict[int, list[int]] = {}
    for op, k in operations:
        rid = k % 3
        try:
            if op == "start" and rid not in tokens:
                prompt = [k % 2] * (4 * (k % 3) + 1 + k)  # a few shared prefixes
                found = cache.match(digests(prompt)[: (len(prompt) - 1) // TPB])
                cache.allocate(rid, len(prompt), prefix=found)
                tokens[rid] = prompt
            elif op == "grow" and rid in tokens:
                cache.extend(rid, k)
                tokens[rid] += [7] * k
            elif op == "publish" and rid in tokens:
                cache.publish(rid, digests(tokens[rid]))
            elif op == "free":
                cache.free(rid)
                tokens.pop(rid, None)
            elif op == "fork" and rid in tokens and (rid + 1) % 3 not in tokens:
                cache.fork(rid, (rid + 1) % 3)
                tokens[(rid + 1) % 3] = list(tokens[rid])
            elif op == "cut" and rid in tokens:
                cut = max(0, len(tokens[rid]) - k)
                cache.truncate(rid, cut)
                tokens[rid] = tokens[rid][:cut]
            elif op == "clear":
                cache.clear_cache()
        except (KVCacheFull, ValueError):
            pass  # refused as a whole: the checks below hold all the same
        tables = {r: cache.block_table(r) for r in tokens}
        named = [b for t in tables.values() for b in t]
        stats = cache.stats()
        assert stats.used_blocks == len(set(named)) and stats.used_blocks + stats.free_blocks == 12
        assert stats.cached_free_blocks <= stats.cached_blocks and not set(cache._free) & set(named)
        assert cache.shared_blocks() == sum(named.count(b) > 1 for b in set(named))
    for rid in list(tokens):
        cache.free(rid)
    assert cache.num_free_blocks == 12 and cache.stats().used_blocks == 0
