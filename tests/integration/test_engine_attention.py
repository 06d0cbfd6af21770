"""paged_attention against a direct float64 computation, on a ragged batch that mixes a
continued prefill chunk, a fresh prefill and a decode token, with blocks scattered in the pool;
an e4m3 pool against the same computation over its keys and values rounded and scaled back."""

from __future__ import annotations

import math

import pytest
import torch

from bootstrap.engine.kv_cache import KVCacheSpec, PagedKVCache
from bootstrap.engine.layers.attention import AttentionGroup, AttentionMetadata, paged_attention, use_metadata
from bootstrap.engine.layers.fp8 import FP8, to_fp8

HEADS, KV_HEADS, DIM, TPB = 4, 2, 8, 4
# (tokens already cached, new tokens this step) per request
REQUESTS = [(5, 3), (9, 1), (0, 6), (3, 1)]  # decode tokens between prefill chunks


class Layer(torch.nn.Module):
    layer_idx = 1


def reference(q, k, v, cached, window, softcap, scale):
    """q [n, H, D] at positions cached..cached+n-1; k, v [cached + n, KVH, D]."""
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(cached, cached + q.shape[0]).unsqueeze(1)
    k_pos = torch.arange(k.shape[0]).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


FP8_SCALES = (0.25, 0.5)  # layer 1's key and value scales in the e4m3 tests


def setup(requests, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(KVCacheSpec(2, KV_HEADS, DIM, dtype), num_blocks=32, tokens_per_block=TPB, device="cpu")
    if dtype == FP8:
        cache.take_scales([1.0, FP8_SCALES[0]], [1.0, FP8_SCALES[1]])
    cache.allocate("filler", 5)  # so request blocks do not start at 0
    full_k, full_v = [], []
    for i, (cached, new) in enumerate(requests):
        k = torch.randn(cached + new, KV_HEADS, DIM, generator=gen)
        v = torch.randn(cached + new, KV_HEADS, DIM, generator=gen)
        cache.allocate(i, cached)
        slots = cache.slots(i, 0, cached)
        for part, values, scale in ((cache.k_cache(1), k, FP8_SCALES[0]), (cache.v_cache(1), v, FP8_SCALES[1])):
            stored = to_fp8(values[:cached], torch.tensor(scale)) if dtype == FP8 else values[:cached].to(dtype)
            part.view(-1, KV_HEADS, DIM).view(torch.uint8 if dtype == FP8 else dtype)[slots] = stored.view(
                torch.uint8 if dtype == FP8 else dtype
            )
        cache.extend(i, new)
        cache.allocate(f"gap{i}", 3)  # interleave other requests' blocks
        full_k.append(k)
        full_v.append(v)
    return cache, full_k, full_v


def step_inputs(requests, full_k, full_v, seed):
    """A step's seeded queries ``[1, H, T, D]`` and its new keys and values (the tokens past each
    request's cached ones), laid out as transformers hands them to ``paged_attention``."""
    total = sum(n for _, n in requests)
    query = torch.randn(1, HEADS, total, DIM, generator=torch.Generator().manual_seed(seed))
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, requests)]).transpose(0, 1).unsqueeze(0)
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, requests)]).transpose(0, 1).unsqueeze(0)
    return query, key, value


def host_lengths(requests, on_host=True):
    """(context, query tokens) per request, as ``ModelRunner`` gives its groups; () as unknown."""
    return tuple((c + n, n) for c, n in requests) if on_host else ()


def metadata(cache, requests, on_host=False):
    tables = [cache.block_table(i) for i in range(len(requests))]
    width = max(map(len, tables))
    slots = torch.cat([cache.slots(i, c, c + n) for i, (c, n) in enumerate(requests)])
    return AttentionMetadata.single(
        cache,
        slot_mapping=slots,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens=torch.tensor([c + n for c, n in requests]),
        query_lens=torch.tensor([n for _, n in requests]),
        max_query_len=max(n for _, n in requests),
        kv_blocks=width,
        lengths=host_lengths(requests, on_host),
    )


def grouped_metadata(cache, requests, on_host=False):
    """Two groups, one-token queries apart from longer ones, their tokens interleaved in T; a
    group whose members have nothing cached is marked fresh, as ``ModelRunner`` marks it."""
    counts = [n for _, n in requests]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    groups = []
    for members in ([i for i, n in enumerate(counts) if n == 1], [i for i, n in enumerate(counts) if n > 1]):
        tables = [cache.block_table(i) for i in members]
        width = max(map(len, tables))
        groups.append(
            AttentionGroup(
                block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                context_lens=torch.tensor([sum(requests[i]) for i in members]),
                query_lens=torch.tensor([counts[i] for i in members]),
                query_starts=torch.tensor([starts[i] for i in members]),
                num_tokens=sum(counts[i] for i in members),
                max_query_len=max(counts[i] for i in members),
                kv_blocks=width,
                tokens_per_block=TPB,
                fresh=all(requests[i][0] == 0 for i in members),
                lengths=host_lengths([requests[i] for i in members], on_host),
            )
        )
    slots = torch.cat([cache.slots(i, c, c + n) for i, (c, n) in enumerate(requests)])
    return AttentionMetadata(cache, slots, groups)


@pytest.mark.parametrize("on_host", [False, True])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (20, None), (None, 2.0), (3, 1.5)])
def test_ragged_paged_attention_matches_direct_computation(window, softcap, grouped, on_host):
    """With the lengths on the host, requests under no window (or one past every context: 20) and
    no soft-cap go one by one under a lower-right causal bias; the rest, one masked call."""
    requests = REQUESTS
    cache, full_k, full_v = setup(requests)
    total = sum(n for _, n in requests)
    query, key, value = step_inputs(requests, full_k, full_v, seed=1)
    scale = 0.3
    meta = grouped_metadata(cache, requests, on_host) if grouped else metadata(cache, requests, on_host)
    with use_metadata(meta):
        out, _ = paged_attention(
            Layer(), query, key, value, None, scaling=scale, sliding_window=window, softcap=softcap
        )
    assert out.shape == (1, total, HEADS, DIM)
    start = 0
    for i, (cached, new) in enumerate(requests):
        q = query[0, :, start : start + new].transpose(0, 1)
        want = reference(q, full_k[i], full_v[i], cached, window, softcap, scale)
        torch.testing.assert_close(out[0, start : start + new].double(), want, atol=1e-5, rtol=1e-5)
        start += new


@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (3, None), (None, 2.0)])
def test_fresh_prompts_match_direct_computation(window, softcap):
    """Prompts with nothing cached (of unequal lengths, so padded) beside decode tokens: the fresh
    group attends its own new keys under a causal flag where no window cuts the prompt and no
    soft-cap applies (window 6 >= the longest prompt), and gathers otherwise; same result."""
    requests = [(0, 5), (7, 1), (0, 2), (0, 6)]
    cache, full_k, full_v = setup(requests)
    query, key, value = step_inputs(requests, full_k, full_v, seed=3)
    meta = grouped_metadata(cache, requests)
    assert [g.fresh for g in meta.groups] == [False, True]
    with use_metadata(meta):
        out, _ = paged_attention(Layer(), query, key, value, None, scaling=0.3, sliding_window=window, softcap=softcap)
    start = 0
    for i, (cached, new) in enumerate(requests):
        q = query[0, :, start : start + new].transpose(0, 1)
        want = reference(q, full_k[i], full_v[i], cached, window, softcap, 0.3)
        torch.testing.assert_close(out[0, start : start + new].double(), want, atol=1e-5, rtol=1e-5)
        start += new


def test_new_keys_and_values_land_in_their_slots():
    requests = [(2, 3)]
    cache, full_k, full_v = setup(requests)
    key = full_k[0][2:].transpose(0, 1).unsqueeze(0)
    value = full_v[0][2:].transpose(0, 1).unsqueeze(0)
    query = torch.zeros(1, HEADS, 3, DIM)
    with use_metadata(metadata(cache, requests)):
        paged_attention(Layer(), query, key, value, None, scaling=1 / math.sqrt(DIM))
    slots = cache.slots(0, 0, 5)
    torch.testing.assert_close(cache.k_cache(1).view(-1, KV_HEADS, DIM)[slots], full_k[0])
    torch.testing.assert_close(cache.v_cache(1).view(-1, KV_HEADS, DIM)[slots], full_v[0])
    assert cache.k_cache(0).abs().sum() == 0  # layer 0 untouched


def test_bfloat16_cache_with_float32_queries():
    requests = [(6, 2), (0, 3)]
    cache, full_k, full_v = setup(requests, dtype=torch.bfloat16)
    query = torch.randn(1, HEADS, 5, DIM, generator=torch.Generator().manual_seed(2))
    key = torch.cat([full_k[0][6:], full_k[1]]).transpose(0, 1).unsqueeze(0)
    value = torch.cat([full_v[0][6:], full_v[1]]).transpose(0, 1).unsqueeze(0)
    with use_metadata(metadata(cache, requests)):
        out, _ = paged_attention(Layer(), query, key, value, None, scaling=0.35)
    want = reference(query[0, :, :2].transpose(0, 1), full_k[0], full_v[0], 6, None, None, 0.35)
    torch.testing.assert_close(out[0, :2].double(), want, atol=3e-2, rtol=3e-2)


def test_calling_outside_a_step_is_a_clear_error():
    q = torch.zeros(1, HEADS, 1, DIM)
    k = torch.zeros(1, KV_HEADS, 1, DIM)
    with pytest.raises(RuntimeError, match="outside a step"):
        paged_attention(Layer(), q, k, k, None)


def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an e4m3 pool gives back of ``x``: rounded at ``x / scale``, multiplied back."""
    return to_fp8(x, torch.tensor(scale)).float() * scale


@pytest.mark.parametrize("on_host", [False, True])
@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 2.0), (3, 1.5)])
def test_an_fp8_pool_attends_over_its_keys_and_values_rounded_and_scaled_back(window, softcap, on_host):
    """Every group gathers from the pool (none is fresh), the step's own keys included."""
    cache, full_k, full_v = setup(REQUESTS, dtype=FP8)
    query, key, value = step_inputs(REQUESTS, full_k, full_v, seed=1)
    with use_metadata(metadata(cache, REQUESTS, on_host)):
        out, _ = paged_attention(Layer(), query, key, value, None, scaling=0.3, sliding_window=window, softcap=softcap)
    start = 0
    for i, (cached, new) in enumerate(REQUESTS):
        q = query[0, :, start : start + new].transpose(0, 1)
        k, v = rounded(full_k[i], FP8_SCALES[0]), rounded(full_v[i], FP8_SCALES[1])
        want = reference(q, k, v, cached, window, softcap, 0.3)
        torch.testing.assert_close(out[0, start : start + new].double(), want, atol=1e-5, rtol=1e-5)
        start += new
    slots = cache.slots(0, 0, sum(REQUESTS[0]))  # the new keys stored as their e4m3 bits, scaled
    stored = cache.k_cache(1).view(-1, KV_HEADS, DIM)[slots].view(torch.uint8)
    assert torch.equal(stored, to_fp8(full_k[0], torch.tensor(FP8_SCALES[0])).view(torch.uint8))


def test_fresh_prompts_in_an_fp8_pool_attend_their_own_keys_as_the_pool_holds_them():
    requests = [(0, 5), (7, 1), (0, 2)]
    cache, full_k, full_v = setup(requests, dtype=FP8)
    query, key, value = step_inputs(requests, full_k, full_v, seed=3)
    with use_metadata(grouped_metadata(cache, requests)):
        out, _ = paged_attention(Layer(), query, key, value, None, scaling=0.3)
    for i, start in ((0, 0), (2, 6)):
        q = query[0, :, start : start + requests[i][1]].transpose(0, 1)
        k, v = rounded(full_k[i], FP8_SCALES[0]), rounded(full_v[i], FP8_SCALES[1])
        want = reference(q, k, v, 0, None, None, 0.3)
        torch.testing.assert_close(out[0, start : start + requests[i][1]].double(), want, atol=1e-5, rtol=1e-5)
