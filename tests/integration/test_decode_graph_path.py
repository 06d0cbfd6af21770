"""The static-shape decode path that CUDA graphs capture, run eagerly on the CPU.

A CUDA graph replays ``ModelRunner.forward_decode`` over the runner's buffers; here a stand-in
"replays" by running that same function eagerly, so the padded buckets, the static-width block
tables, the write rows and ``DecodeMetadata`` attention are checked on any machine: against a
direct float64 computation, and end to end against transformers ``generate()`` (greedy, float32)
with batch sizes between buckets and requests finishing mid-batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_models import BUILDERS, build
from test_engine_attention import DIM, HEADS, KV_HEADS, Layer, reference, setup
from test_engine_parity import prompts
from test_engine_parity import reference as generate_reference

from bootstrap import BootstrapConfig
from bootstrap.capacity.cuda_graph_buckets import (
    decode_widths,
    default_batch_sizes,
    fewer_batch_sizes,
    speculative_batch_sizes,
)
from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.layers.attention import DecodeMetadata, paged_attention, use_metadata
from bootstrap.engine.spec.depth import ROW_TOKENS
from bootstrap.engine.spec.rows import graph_sizes
from bootstrap.engine.step.graphs import DecodeGraphs


class EagerBuckets:
    """Stands in for ``DecodeGraphs`` on the CPU: same buckets, ``replay`` runs the forward."""

    bucket = DecodeGraphs.bucket

    def __init__(self, runner, batch_sizes, widths):
        self.runner, self.batch_sizes, self.widths = runner, tuple(batch_sizes), tuple(widths)
        self.replayed: list[tuple[int, int]] = []

    def replay(self, bucket):
        self.replayed.append(bucket)
        return self.runner.forward_decode(*bucket)

    def release(self):
        self.batch_sizes, self.widths = (), ()


def test_bucket_sizes():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    assert default_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert decode_widths(10, 32) == [8, 10]  # 256 tokens, then max_seq_len 320
    assert decode_widths(4096, 32) == [8, 16, 32, 64, 128, 256]  # up to 8,192 tokens
    assert decode_widths(3, 16) == [3]
    assert fewer_batch_sizes([1, 2, 4, 8, 16]) == [1, 2]
    assert fewer_batch_sizes([1]) == [1]
    assert speculative_batch_sizes([1, 2, 4, 8], 5) == [1, 2, 4, 5, 8, 10, 20, 40]  # verify rows, k = 4
    assert speculative_batch_sizes([64, 100, 128], 5) == [64, 100, 128, 320, 500]  # none past 512 rows
    assert speculative_batch_sizes([1, 3], 2) == [1, 2, 3, 6]


def test_with_auto_the_draft_captures_passes_of_requests_catching_up_after_a_pause():
    def draft_sizes(depth):
        config = BootstrapConfig(
            model="random:llama-3.2-1b",
            draft_model="random:llama-3.2-1b",
            max_batch_size=32,
            num_speculative_tokens=depth,
        )
        return graph_sizes(config, default_batch_sizes(32))["draft"]

    assert draft_sizes(4) == [1, 2, 4, 8, 16, 24, 32, 48, 64]  # the buckets, and two rows a request
    assert ROW_TOKENS == 18  # then ROW_TOKENS rows a request, up to 512 rows
    assert draft_sizes("auto") == [1, 2, 4, 8, 16, 18, 24, 32, 36, 48, 64, 72, 144, 288, 432]


def test_bucket_choice_pads_up_and_falls_back_past_the_largest():
    graphs = EagerBuckets(None, [1, 2, 4, 8], [2, 4])
    assert graphs.bucket(1, 1) == (1, 2)
    assert graphs.bucket(3, 3) == (4, 4)
    assert graphs.bucket(8, 4) == (8, 4)
    assert graphs.bucket(9, 1) is None and graphs.bucket(1, 5) is None


@pytest.mark.parametrize("window, softcap", [(None, None), (4, None), (None, 2.0), (3, 1.5)])
def test_decode_metadata_attention_with_padding_rows_and_wide_tables(window, softcap):
    requests = [(5, 1), (9, 1), (2, 1)]
    cache, full_k, full_v = setup(requests)
    rows, width = 5, 6  # two padding rows; wider than any table (3 blocks)
    tables = [cache.block_table(i) for i in range(3)]
    tables = [t + [0] * (width - len(t)) for t in tables]
    pad = [2, 2]
    slots = torch.cat([cache.slots(i, c, c + 1) for i, (c, _) in enumerate(requests)])
    meta = DecodeMetadata(
        cache,
        slot_mapping=torch.cat([slots, slots[-1:].repeat(2)]),
        write_rows=torch.tensor([0, 1, 2, *pad]),
        block_tables=torch.tensor(tables + [tables[2]] * 2),
        context_lens=torch.tensor([c + 1 for c, _ in requests] + [3, 3]),
    )
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(1, HEADS, rows, DIM, generator=gen)
    new_k = torch.stack([k[c] for k, (c, _) in zip(full_k, requests)])
    new_v = torch.stack([v[c] for v, (c, _) in zip(full_v, requests)])
    garbage = torch.randn(2, KV_HEADS, DIM, generator=gen)  # what padding rows compute: never stored
    key = torch.cat([new_k, garbage]).transpose(0, 1).unsqueeze(0)
    value = torch.cat([new_v, garbage]).transpose(0, 1).unsqueeze(0)
    with use_metadata(meta):
        out, _ = paged_attention(Layer(), query, key, value, None, scaling=0.3, sliding_window=window, softcap=softcap)
    assert out.shape == (1, rows, HEADS, DIM)
    for i, (cached, _) in enumerate(requests):
        want = reference(query[0, :, i : i + 1].transpose(0, 1), full_k[i], full_v[i], cached, window, softcap, 0.3)
        torch.testing.assert_close(out[0, i : i + 1].double(), want, atol=1e-5, rtol=1e-5)
    flat_k = cache.k_cache(1).view(-1, KV_HEADS, DIM)
    torch.testing.assert_close(flat_k[slots], new_k)  # the padding rows wrote row 2's key again


def engine(model, batch_sizes, widths, *, tokens_per_block=4, max_batch_size=8, max_seq_len=64):
    spec = KVCacheSpec.from_config(model.config, torch.float32)
    cache = PagedKVCache.from_tokens(spec, 2048, tokens_per_block, "cpu")
    ex = create_executor(copy.deepcopy(model), cache, SchedulerConfig(max_batch_size, 64, max_seq_len), start=False)
    ex.runner.graphs = EagerBuckets(ex.runner, batch_sizes, widths)
    return ex


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_padded_buckets_match_generate_with_requests_finishing_mid_batch(name):
    """7 requests over buckets 1, 2, 4, 8 and widths 2, 4, 6 blocks: steps of 7, then fewer rows
    as short requests finish (padded to 8, then 4), contexts crossing width buckets; past 6 blocks
    (24 tokens) steps run eagerly."""
    model = build(name)
    batch = prompts(7, 1, 10, seed=11)
    lengths = [3, 16, 5, 9, 12, 1, 7]
    ex = engine(model, [1, 2, 4, 8], [2, 4, 6])
    responses = ex.generate(batch, [SamplingParams(max_tokens=n) for n in lengths])
    for prompt, n, response in zip(batch, lengths, responses):
        assert response.error is None
        assert response.token_ids == generate_reference(model, prompt, n), f"prompt of {len(prompt)} tokens"
    replayed = ex.runner.graphs.replayed
    assert {rows for rows, _ in replayed} >= {8, 4} and len({w for _, w in replayed}) >= 2
    assert ex.scheduler.kv_cache.stats().used_blocks == 0
    ex.shutdown()


def test_decode_buffers_pad_rows_and_tables():
    from bootstrap.engine.step.model_runner import DecodeBuffers, DecodeStep

    buf = DecodeBuffers(4, 6, 10, torch.device("cpu"))
    buf.block_tables.fill_(7)
    size = buf.fill(DecodeStep([11, 12], [4, 9], [40, 91], [[3], [5, 6, 8]]), rows=3, width=4)
    assert size == 2
    assert buf.input_ids[:3].tolist() == [11, 12, 12]
    assert buf.context_lens[:3].tolist() == [5, 10, 10]
    assert buf.slot_mapping[:3].tolist() == [40, 91, 91]
    assert buf.write_rows[:3].tolist() == [0, 1, 1]
    assert buf.block_tables[:3].tolist() == [[3, 0, 0, 0, 7, 7], [5, 6, 8, 0, 7, 7], [5, 6, 8, 0, 7, 7]]
    with pytest.raises(ValueError):
        buf.fill(DecodeStep([1], [0], [0], [[1, 2, 3]]), rows=1, width=2)
    buf.fill(DecodeStep([11, 12], [4, 9], [40, 91], [[3], [5, 6, 8]]), rows=3, tokens=torch.tensor([21, 22]))
    assert buf.input_ids[:3].tolist() == [21, 22, 12]  # the device's ids; a padding row keeps the host's
    verify = DecodeStep([11, 0, 13, 0], [4, 5, 9, 10], [40, 41, 91, 92], [[3], [3], [5, 6], [5, 6]])
    buf.fill(verify, tokens=torch.tensor([[31], [32]]))  # each request's proposal after its own last token
    assert buf.input_ids[:4].tolist() == [11, 31, 13, 32]


def test_decode_buffers_move_rows_by_offsets_on_the_device():
    """Rows placed by a verdict the host has not read: positions moved by device offsets, their
    context lengths and slots (blocks of 10 tokens here) derived from the block tables, padding
    rows moved with their real row."""
    from bootstrap.engine.step.model_runner import DecodeBuffers, DecodeStep

    buf = DecodeBuffers(4, 6, 10, torch.device("cpu"))
    step = DecodeStep([11, 12], [4, 9], [34, 69], [[3], [5, 6, 8]])
    buf.fill(step, rows=3, offsets=torch.tensor([2, 3]))
    assert buf.positions[:3].tolist() == [6, 12, 12]
    assert buf.context_lens[:3].tolist() == [7, 13, 13]
    assert buf.slot_mapping[:3].tolist() == [36, 62, 62]  # block 3 at 6; block 6 (the second) at 2
    buf.fill(step, rows=3)  # no offsets: the host's values again
    assert buf.positions[:3].tolist() == [4, 9, 9] and buf.slot_mapping[:3].tolist() == [34, 69, 69]
