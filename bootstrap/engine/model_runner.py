"""Runs a scheduled batch through a transformers causal LM over the paged KV cache.

The batch is flattened into one row: ``input_ids`` and ``position_ids`` of shape
``[1, total_tokens]``, every request's new tokens back to back. The model's attention layers call
``paged_attention`` (the model is switched to ``attn_implementation="bootstrap_paged"``), which
reads the step's metadata from a thread-local. The model computes logits only at the last token
of each request that samples this step (``logits_to_keep`` with explicit indices), so the
vocabulary projection never runs over a whole prompt.

Decode steps fill preallocated buffers (inputs, positions, slots, lengths, and block tables of
static width ``ceil(max_seq_len / tokens_per_block)``) and run on views of them: the shape a CUDA
graph per batch-size bucket needs. Mixed steps (prefill chunks and decode tokens) build fresh
tensors. Nothing here is CUDA-only; the CPU path runs as is.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from bootstrap.engine.attention import ATTN_IMPLEMENTATION, AttentionGroup, AttentionMetadata, use_metadata
from bootstrap.engine.kv_cache import KVCacheSpec, PagedKVCache
from bootstrap.engine.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    logits_index: torch.Tensor  # [S]: flat index of the last token of each sampling request
    metadata: AttentionMetadata


class DecodeBuffers:
    """Preallocated, fixed-shape inputs of a decode step (one token per request)."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids = zeros(max_batch_size)
        self.positions = zeros(max_batch_size)
        self.slot_mapping = zeros(max_batch_size)
        self.context_lens = zeros(max_batch_size)
        self.query_lens = torch.ones(max_batch_size, dtype=torch.long, device=device)
        self.logits_index = torch.arange(max_batch_size, device=device)
        self.block_tables = zeros(max_batch_size, max_blocks_per_seq)

    def fill(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> int:
        """Copy one step's values into the first ``len(ids)`` rows; return that batch size.

        Only the block-table columns in use are written; later columns keep older block ids,
        which are valid indices and lie past every request's length, so they are masked out.
        """
        size = len(ids)
        width = max(len(table) for table in tables)
        padded = [table + [0] * (width - len(table)) for table in tables]
        host = torch.tensor([ids, positions, slots], dtype=torch.long)
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2], non_blocking=True)
        self.context_lens[:size].copy_(host[1] + 1, non_blocking=True)
        self.block_tables[:size, :width].copy_(torch.tensor(padded, dtype=torch.long), non_blocking=True)
        return size


class ModelRunner:
    """Owns the forward pass: input preparation, attention metadata, last-token logits."""

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, max_batch_size: int, max_seq_len: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.get_text_config().vocab_size
        _check_cache_matches(model, kv_cache)
        _check_positions(model, max_seq_len)
        _use_paged_attention(model)
        self.max_blocks_per_seq = kv_cache.blocks_needed(max_seq_len)
        self.decode_buffers = DecodeBuffers(max_batch_size, self.max_blocks_per_seq, self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits ``[S, vocab]`` at the last token of each request of ``batch`` that samples now."""
        inputs = self.prepare_decode(batch) if batch.is_decode else self.prepare_mixed(batch)
        with use_metadata(inputs.metadata):
            out = self.model(
                input_ids=inputs.input_ids,
                position_ids=inputs.positions,
                logits_to_keep=inputs.logits_index,
                use_cache=False,
            )
        return out.logits[0]

    def prepare_decode(self, batch: ScheduledBatch) -> StepInputs:
        """Decode-only step on views of the preallocated buffers."""
        seqs, buf = batch.seqs, self.decode_buffers
        positions = [s.num_computed for s in seqs]
        tables = [self.kv_cache.block_table(s.request_id) for s in seqs]
        slots = [self._slot(table, pos) for table, pos in zip(tables, positions)]
        size = buf.fill([s.token_ids[-1] for s in seqs], positions, slots, tables)
        metadata = AttentionMetadata.single(
            self.kv_cache,
            slot_mapping=buf.slot_mapping[:size],
            block_tables=buf.block_tables[:size],
            context_lens=buf.context_lens[:size],
            query_lens=buf.query_lens[:size],
            max_query_len=1,
            kv_blocks=max(len(t) for t in tables),
        )
        ids, pos = buf.input_ids[:size].unsqueeze(0), buf.positions[:size].unsqueeze(0)
        return StepInputs(ids, pos, buf.logits_index[:size], metadata)

    def _slot(self, table: list[int], position: int) -> int:
        tpb = self.kv_cache.tokens_per_block
        return table[position // tpb] * tpb + position % tpb

    def prepare_mixed(self, batch: ScheduledBatch) -> StepInputs:
        """Any step: prefill chunks and decode tokens of several requests, flattened."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed
            ids += seq.token_ids[start : start + count]
            positions += range(start, start + count)
            slots.append(self.kv_cache.slots(seq.request_id, start, start + count))
        counts = torch.tensor(batch.num_new_tokens, dtype=torch.long)
        ends = torch.cumsum(counts, 0) - 1
        keep = ends[torch.tensor(batch.samples(), dtype=torch.bool)]
        metadata = AttentionMetadata(self.kv_cache, self._to_device(torch.cat(slots)), self._groups(batch))
        as_row = self._to_device(torch.tensor([ids, positions], dtype=torch.long))
        return StepInputs(as_row[0:1], as_row[1:2], self._to_device(keep), metadata)

    def _groups(self, batch: ScheduledBatch) -> list[AttentionGroup]:
        """One attention group for the one-token queries and one for the longer chunks."""
        counts = batch.num_new_tokens
        starts = [0, *itertools.accumulate(counts)][:-1]
        short = [i for i, n in enumerate(counts) if n == 1]
        long_ = [i for i, n in enumerate(counts) if n > 1]
        if not short or not long_:
            return [self._group(batch, list(range(len(counts))), starts)]
        return [self._group(batch, short, starts), self._group(batch, long_, starts)]

    def _group(self, batch: ScheduledBatch, members: list[int], starts: list[int]) -> AttentionGroup:
        tables = [self.kv_cache.block_table(batch.seqs[i].request_id) for i in members]
        width = max(len(t) for t in tables)
        counts = [batch.num_new_tokens[i] for i in members]
        lengths = [[batch.seqs[i].num_computed + batch.num_new_tokens[i] for i in members], counts, [starts[i] for i in members]]
        context_lens, query_lens, query_starts = self._to_device(torch.tensor(lengths, dtype=torch.long))
        return AttentionGroup(
            block_tables=self._to_device(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)),
            context_lens=context_lens,
            query_lens=query_lens,
            query_starts=query_starts,
            num_tokens=sum(counts),
            max_query_len=max(counts),
            kv_blocks=width,
            tokens_per_block=self.kv_cache.tokens_per_block,
        )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)


def _use_paged_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (in place) to the paged attention function, or say why it cannot be."""
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            f"so '{ATTN_IMPLEMENTATION}' cannot be set on it; the native engine cannot run this model"
        )


def _check_positions(model: torch.nn.Module, max_seq_len: int) -> None:
    """Refuse a ``max_seq_len`` past the model's positions (an index error deep in the model)."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and max_seq_len > limit:
        raise ValueError(
            f"SchedulerConfig.max_seq_len ({max_seq_len}) exceeds the model's max_position_embeddings "
            f"({limit}); use max_seq_len <= {limit}"
        )


def _check_cache_matches(model: torch.nn.Module, kv_cache: PagedKVCache) -> None:
    """The pool holds this rank's KV heads: all of them, or ``kv_heads / tp`` for a model
    sharded by transformers' tensor-parallel plan (its ``tp_size``)."""
    tp = getattr(model, "tp_size", None) or 1
    expected = KVCacheSpec.from_config(model.config, kv_cache.spec.dtype, tp=tp)
    if expected != kv_cache.spec:
        raise ValueError(f"the KV cache was built for {kv_cache.spec}, but the model needs {expected}")
