"""Runs a scheduled batch through a causal LM over the paged KV cache: the engine's own model
code (``bootstrap.engine.models``) or a transformers model (``step.hf_model``).

The batch is flattened into one row: ``input_ids`` and ``position_ids`` of shape
``[1, total_tokens]``, every request's new tokens back to back. The model computes logits only
at the last token of each request that samples this step (``logits_to_keep`` with explicit
indices), so the vocabulary projection never runs over a whole prompt. Decode steps, and the
other steps of one-token rows (``run_rows``: speculative decoding's verify and draft passes),
fill preallocated buffers (``step.decode_step``) and run on views of them; after
``capture_decode_graphs`` (CUDA) such a step that a captured bucket covers is replayed as a
CUDA graph (``step.graphs``). Mixed steps, steps no bucket covers and every step on the CPU run
eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from bootstrap.capacity.cuda_graph_buckets import decode_widths
from bootstrap.engine.kernels import paged_kv
from bootstrap.engine.kv_cache import KVCacheSpec, PagedKVCache
from bootstrap.engine.layers.attention import AttentionGroup, AttentionMetadata, DecodeMetadata
from bootstrap.engine.models.decoder import DecoderLM
from bootstrap.engine.step import hf_model
from bootstrap.engine.step.batch import ScheduledBatch
from bootstrap.engine.step.decode_step import DecodeBuffers, DecodeStep, queued_tensor
from bootstrap.engine.step.graphs import DecodeGraphs, GraphCapture
from bootstrap.engine.step.mixed_step import BlockCopy, GroupRows, MixedStep, RowsStep, describe


class Lockstep(Protocol):
    """Where a runner sends each step's host inputs before it runs them, so that other ranks run
    the same forward on their shards (``bootstrap.parallel.lockstep.Leader``)."""

    def send(self, step: MixedStep | RowsStep | BlockCopy, tensors: Sequence[torch.Tensor] = ()) -> None: ...

    def failed(self, exc: BaseException) -> None: ...


@dataclass(frozen=True)
class Feed:
    """Ids sampled on the device by the step before (overlap scheduling): the step's flat
    token ``index[i]`` runs ``tokens[i]``."""

    index: list[int]
    tokens: torch.Tensor  # [len(index)] long, on the runner's device

    def into(self, ids: Sequence[int], device: torch.device) -> torch.Tensor:
        """``ids`` on ``device`` with this feed's tokens in place."""
        return queued_tensor(device, list(ids)).index_copy_(0, queued_tensor(device, self.index), self.tokens)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    logits_index: torch.Tensor  # [S]: flat index of the last token of each sampling request
    metadata: AttentionMetadata


class ModelRunner:
    """Owns the forward pass: input preparation, attention metadata, last-token logits."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        max_batch_size: int,
        max_seq_len: int,
        decode_kernel: str = "auto",
        max_rows: int | None = None,
    ) -> None:
        """``max_rows``: the most one-token rows a step of ``run_rows`` holds (default
        ``max_batch_size``; speculative decoding's verify pass needs ``k + 1`` per request)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.get_text_config().vocab_size
        _check_cache_matches(model, kv_cache)
        _check_positions(model, max_seq_len)
        if not isinstance(model, DecoderLM):
            hf_model.use_paged_attention(model)
        self.max_batch_size = max_batch_size
        self.max_rows = max(max_rows or max_batch_size, max_batch_size)
        self.max_blocks_per_seq = kv_cache.blocks_needed(max_seq_len)
        self.decode_buffers = DecodeBuffers(
            self.max_rows, self.max_blocks_per_seq, kv_cache.tokens_per_block, self.device
        )
        self.graphs: DecodeGraphs | None = None  # set by capture_decode_graphs
        self.decode_kernel = self._decode_kernel(decode_kernel)
        self.lockstep: Lockstep | None = None  # set by lead()
        self.role = "target"  # the name other ranks know this runner by (lead)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, feed: Feed | None = None) -> torch.Tensor:
        """Logits ``[S, vocab]`` at the last token of each request of ``batch`` that samples now.

        A decode step runs as ``run_rows`` (a captured CUDA graph when one covers it); any other
        step runs eagerly. ``feed``: ids still on the device (overlap scheduling), put in place
        of the host's at their flat indices; not with a lockstep (other ranks get host ids).
        """
        if feed is not None and self.lockstep is not None:
            raise ValueError("a step fed ids on the device cannot be sent to other ranks")
        if batch.is_decode:
            step = self.decode_step(batch)
            return self.run_rows(step, tokens=None if feed is None else feed.into(step.ids, self.device))
        step = describe(batch, self.kv_cache, self.role)
        with self._sent(step):
            inputs = self.prepare_mixed(step)
            if feed is not None:
                inputs.input_ids[0].index_copy_(0, queued_tensor(self.device, feed.index), feed.tokens)
            return self._forward(inputs.input_ids, inputs.positions, inputs.logits_index, inputs.metadata)

    @torch.inference_mode()
    def run_rows(
        self,
        step: DecodeStep,
        tokens: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of a step of one-token rows (``bootstrap.engine.step.decode_step``):
        a decode step, a verify pass, a draft pass. Replays a captured CUDA graph when one covers
        the step's size and width (padded up to the graph's bucket), else runs eagerly.
        ``tokens``: the rows' ids on the device, in place of ``step.ids``; ``offsets``: moves of
        the rows' positions, on the device (``DecodeBuffers.fill``); ``keep``: the rows whose
        logits are wanted (default all; an eager step computes only theirs)."""
        if step.size > self.max_rows:
            raise ValueError(f"a step of {step.size} rows does not fit this runner's max_rows ({self.max_rows})")
        if self.lockstep is None:
            return self._rows(step, tokens, offsets, keep)
        sent = RowsStep(
            step,
            None if keep is None else tuple(keep),
            None if tokens is None else tuple(tokens.shape),
            None if offsets is None else offsets.shape[0],
            self.role,
        )
        with self._sent(sent, *(t for t in (tokens, offsets) if t is not None)):
            return self._rows(step, tokens, offsets, keep)

    def _rows(
        self, step: DecodeStep, tokens: torch.Tensor | None, offsets: torch.Tensor | None, keep: Sequence[int] | None
    ) -> torch.Tensor:
        bucket = self.graphs.bucket(step.size, step.width) if self.graphs is not None else None
        rows = None if keep is None else queued_tensor(self.device, list(keep))
        if bucket is not None:
            self.decode_buffers.fill(step, bucket[0], tokens=tokens, offsets=offsets)  # columns past the width: masked
            logits = self.graphs.replay(bucket)[: step.size]
            return logits if rows is None else logits.index_select(0, rows)
        inputs = self.prepare_decode(step, tokens, offsets)
        return self._forward(
            inputs.input_ids, inputs.positions, inputs.logits_index if rows is None else rows, inputs.metadata
        )

    def lead(self, lockstep: Lockstep | None, role: str = "target") -> None:
        """Send every later step (and the pool's block copies) to ``lockstep`` before running it,
        as the runner ``role`` (``target``, or a speculator's ``draft``); None: run alone again."""
        self.lockstep, self.role = lockstep, role
        self.kv_cache.on_copy = None if lockstep is None else self._send_copy

    def _send_copy(self, sources: Sequence[int], copies: Sequence[int]) -> None:
        self.lockstep.send(BlockCopy(tuple(sources), tuple(copies), self.role))

    @contextlib.contextmanager
    def _sent(self, step: MixedStep | RowsStep | BlockCopy, *tensors: torch.Tensor) -> Iterator[None]:
        """``step`` (and the device ``tensors`` it names) sent before the block runs; a failure
        after it was sent is the lockstep's (the other ranks ran it, or wait in its collectives)."""
        if self.lockstep is None:
            yield
            return
        self.lockstep.send(step, tensors)
        try:
            yield
        except BaseException as exc:
            self.lockstep.failed(exc)
            raise

    @torch.inference_mode()
    def follow(self, step: MixedStep | RowsStep | BlockCopy, receive: Callable[[torch.Tensor], None]) -> None:
        """Run a step that another rank scheduled and sent (``lead``); its logits are that rank's
        to sample, so none are kept here. ``receive`` fills a tensor the step says follows it."""
        if isinstance(step, BlockCopy):
            self.kv_cache.copy_blocks(step.sources, step.copies)
        elif isinstance(step, RowsStep):
            tokens = offsets = None
            if step.tokens is not None:
                receive(tokens := torch.empty(step.tokens, dtype=torch.long, device=self.device))
            if step.offsets is not None:
                receive(offsets := torch.empty(step.offsets, dtype=torch.long, device=self.device))
            self._rows(step.step, tokens, offsets, step.keep)
        elif isinstance(step, MixedStep):
            inputs = self.prepare_mixed(step)
            self._forward(inputs.input_ids, inputs.positions, inputs.logits_index, inputs.metadata)
        else:
            raise TypeError(f"not a step: {type(step).__name__}")

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_to_keep: torch.Tensor | int,
        metadata: AttentionMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        """The engine's own model code takes the metadata as an argument (a transformers model:
        ``hf_model.forward``)."""
        if isinstance(self.model, DecoderLM):
            return self.model(input_ids, positions, logits_to_keep, metadata).logits[0]
        return hf_model.forward(self.model, input_ids, positions, logits_to_keep, metadata)

    def decode_step(self, batch: ScheduledBatch) -> DecodeStep:
        """The host-side values of a decode-only step."""
        return self.token_rows([(s.request_id, s.num_computed, [s.token_ids[-1]]) for s in batch.seqs])

    def token_rows(self, requests: Sequence[tuple[int, int, Sequence[int]]]) -> DecodeStep:
        """The rows of a step where each ``(request id, start, ids)`` runs ``ids`` at positions
        ``start, start + 1, ...`` (their slots already allocated in the pool)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        for request_id, start, tokens in requests:
            table = self.kv_cache.block_table(request_id)
            for position, token in enumerate(tokens, start):
                ids.append(token)
                positions.append(position)
                slots.append(self._slot(table, position))
                tables.append(table)
        return DecodeStep(ids, positions, slots, tables)

    def prepare_decode(
        self, step: DecodeStep | ScheduledBatch, tokens: torch.Tensor | None = None, offsets: torch.Tensor | None = None
    ) -> StepInputs:
        """A step of one-token rows on views of the preallocated buffers (eager: exact size and width)."""
        step = step if isinstance(step, DecodeStep) else self.decode_step(step)
        buf = self.decode_buffers
        size = buf.fill(step, tokens=tokens, offsets=offsets)
        metadata = AttentionMetadata.single(
            self.kv_cache,
            slot_mapping=buf.slot_mapping[:size],
            block_tables=buf.block_tables[:size],
            context_lens=buf.context_lens[:size],
            query_lens=buf.query_lens[:size],
            max_query_len=1,
            kv_blocks=step.width,
            kernel=self.decode_kernel,
        )
        ids, pos = buf.input_ids[:size].unsqueeze(0), buf.positions[:size].unsqueeze(0)
        return StepInputs(ids, pos, buf.logits_index[:size], metadata)

    def decode_metadata(self, rows: int, width: int) -> DecodeMetadata:
        """Static-shape metadata over the first ``rows`` x ``width`` of the decode buffers."""
        buf = self.decode_buffers
        return DecodeMetadata(
            self.kv_cache,
            buf.slot_mapping[:rows],
            buf.write_rows[:rows],
            buf.block_tables[:rows, :width],
            buf.context_lens[:rows],
            self.decode_kernel,
        )

    def forward_decode(self, rows: int, width: int) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of a static-shape decode step over the buffers as filled
        (what a CUDA graph captures; runs eagerly as well, on any device)."""
        buf = self.decode_buffers
        metadata = self.decode_metadata(rows, width)
        return self._forward(buf.input_ids[:rows].unsqueeze(0), buf.positions[:rows].unsqueeze(0), 0, metadata)

    def capture_decode_graphs(
        self,
        batch_sizes: Sequence[int],
        widths: Sequence[int] | None = None,
        compile_norms: bool | None = None,
        compile_layers: bool = False,
    ) -> GraphCapture:
        """Capture decode steps as CUDA graphs for every batch size x width bucket (CUDA only;
        see ``bootstrap.engine.step.graphs``). Replaces any earlier capture. ``compile_norms``:
        first ``torch.compile`` the model's RMSNorm modules (eight kernels each to one; a second
        or so of compiling at the first shapes; every later step, eager ones too, uses them).
        Default: for a transformers model where the Triton decode kernel runs (Triton, which the
        compiler needs, is there); never for the engine's own code, whose norms are fused kernels.
        ``compile_layers`` (experimental): compile whole decoder layers instead, the attention
        function left out of the compiled graphs (longer to compile, fewer kernels still)."""
        self.release_graphs()
        if compile_layers:
            hf_model.compile_layers(self.model)
        if compile_norms if compile_norms is not None else self._compiles_norms():
            hf_model.compile_norms(self.model)
        graphs = DecodeGraphs(self)
        try:
            report = graphs.capture(batch_sizes, widths if widths is not None else self.default_widths())
        except BaseException:
            graphs.release()
            raise
        self.graphs = graphs
        return report

    def _compiles_norms(self) -> bool:
        """By default, a transformers model's norms where the Triton decode kernel runs; the
        engine's own model code has its fused kernels (``layers.fused``) instead."""
        return self.decode_kernel == "triton" and not isinstance(self.model, DecoderLM)

    def default_widths(self) -> list[int]:
        """The paged kernel reads only each row's context: one graph width, the whole table.
        The gathering path reads its whole width: doubling widths up to 8,192 tokens."""
        if self.decode_kernel == "triton":
            return [self.max_blocks_per_seq]
        return decode_widths(self.max_blocks_per_seq, self.kv_cache.tokens_per_block)

    def _decode_kernel(self, choice: str) -> str:
        usable = paged_kv.available(self.device, self.kv_cache.tokens_per_block)
        if choice not in ("auto", "triton", "torch"):
            raise ValueError(f"decode_kernel must be auto, triton or torch, got {choice!r}")
        if choice == "triton" and not usable:
            raise ValueError("decode_kernel 'triton' needs Triton, a CUDA device and at least 16 tokens per block")
        return "triton" if choice == "triton" or (choice == "auto" and usable) else "torch"

    @property
    def pass_rows(self) -> int:
        """The most rows one pass of ``run_rows`` should hold: the largest captured graph's (two
        replays cost less than one eager pass of their rows), else ``max_rows``."""
        return self.graphs.batch_sizes[-1] if self.graphs is not None and self.graphs.batch_sizes else self.max_rows

    def release_graphs(self) -> None:
        """Drop every captured graph and its memory pool (idempotent)."""
        if self.graphs is not None:
            graphs, self.graphs = self.graphs, None
            graphs.release()

    def _slot(self, table: list[int], position: int) -> int:
        tpb = self.kv_cache.tokens_per_block
        return table[position // tpb] * tpb + position % tpb

    def prepare_mixed(self, batch: ScheduledBatch | MixedStep) -> StepInputs:
        """Any step: prefill chunks and decode tokens of several requests, flattened."""
        step = batch if isinstance(batch, MixedStep) else describe(batch, self.kv_cache)
        groups = [self._group(rows) for rows in step.groups]
        metadata = AttentionMetadata(self.kv_cache, self._to_device(step.slots), groups)
        as_row = self._to_device(step.rows)
        return StepInputs(as_row[0:1], as_row[1:2], self._to_device(step.keep), metadata)

    def _group(self, rows: GroupRows) -> AttentionGroup:
        context_lens, query_lens, query_starts = self._to_device(rows.lengths)
        return AttentionGroup(
            block_tables=self._to_device(rows.tables),
            context_lens=context_lens,
            query_lens=query_lens,
            query_starts=query_starts,
            num_tokens=rows.num_tokens,
            max_query_len=rows.max_query_len,
            kv_blocks=rows.tables.shape[1],
            tokens_per_block=self.kv_cache.tokens_per_block,
            fresh=rows.fresh,
            kernel=self.decode_kernel,
            lengths=tuple(zip(rows.lengths[0].tolist(), rows.lengths[1].tolist(), strict=True)),
        )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)


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
