"""Scheduling in two layers, as TensorRT-LLM splits it.

``CapacityScheduler`` decides which waiting requests may start, with the guaranteed-no-evict
policy: a request is admitted only when the KV blocks of its whole life (prompt plus
``max_tokens``) fit in what the running requests have not reserved, so a running request never
runs out of blocks and nothing is ever preempted. Admission is first come, first served: the
head of the queue is never overtaken, so a large request cannot starve.

``MicroBatchScheduler`` picks the tokens of one forward step from the running requests: one
token for every request in decode, then prefill chunks in admission order until
``max_num_tokens`` is reached (a long prompt is split over several steps: chunked prefill).

``Scheduler`` holds the queues and ties the two to the KV cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.prompts import length_problem
from bootstrap.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 32
    max_num_tokens: int = 2048
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_batch_size > self.max_num_tokens:
            raise ValueError(
                f"SchedulerConfig.max_batch_size ({self.max_batch_size}) must be <= max_num_tokens "
                f"({self.max_num_tokens}): every request in a step needs at least one token"
            )


@dataclass
class ScheduledBatch:
    """One forward step: ``num_new_tokens[i]`` tokens of ``seqs[i]``, in this order."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        """True when every request runs exactly its one last sampled token."""
        return all(n == 1 and not s.in_prefill for s, n in zip(self.seqs, self.num_new_tokens))

    def split(self) -> list[ScheduledBatch]:
        """One single-request batch per request, same tokens."""
        return [ScheduledBatch([s], [n]) for s, n in zip(self.seqs, self.num_new_tokens)]

    def samples(self) -> list[bool]:
        """Per request: does this step complete its pending tokens, so a token gets sampled?"""
        return [s.num_computed + n == s.num_tokens for s, n in zip(self.seqs, self.num_new_tokens)]


class CapacityScheduler:
    """Guaranteed-no-evict admission over one KV pool; see the module docstring."""

    def __init__(self, kv_cache: PagedKVCache, max_seq_len: int) -> None:
        self.kv_cache = kv_cache
        self.max_seq_len = max_seq_len
        self._reserved: dict[int, int] = {}

    @property
    def reserved_blocks(self) -> int:
        return sum(self._reserved.values())

    def rejection(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never run with this pool and limit, or None if it can."""
        problem = length_problem(seq.num_prompt_tokens, seq.params.max_tokens, self.max_seq_len)
        if problem is not None:
            return problem
        need = self.kv_cache.blocks_needed(seq.max_kv_tokens)
        if need > self.kv_cache.num_blocks:
            return (
                f"the request needs {need} KV blocks ({seq.max_kv_tokens} tokens) but the whole pool has "
                f"{self.kv_cache.num_blocks} blocks of {self.kv_cache.tokens_per_block} tokens"
            )
        return None

    def try_admit(self, seq: Sequence) -> bool:
        """Reserve the blocks of ``seq``'s whole life if they are free; True on success."""
        need = self.kv_cache.blocks_needed(seq.max_kv_tokens)
        if self.reserved_blocks + need > self.kv_cache.num_blocks:
            return False
        self._reserved[seq.request_id] = need
        return True

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s reservation and return its blocks to the pool (idempotent)."""
        self._reserved.pop(seq.request_id, None)
        self.kv_cache.free(seq.request_id)


class MicroBatchScheduler:
    """Token-budgeted step selection with chunked prefill; see the module docstring."""

    def __init__(self, max_batch_size: int, max_num_tokens: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens

    def plan(self, running: list[Sequence]) -> ScheduledBatch:
        """Decode tokens first, then prefill chunks, within the batch and token limits."""
        decodes = [s for s in running if not s.in_prefill][: self.max_batch_size]
        seqs, counts = list(decodes), [s.num_pending for s in decodes]
        budget = self.max_num_tokens - sum(counts)
        for seq in running:
            if budget <= 0 or len(seqs) >= self.max_batch_size:
                break
            if seq.in_prefill:
                chunk = min(seq.num_pending, budget)
                seqs.append(seq)
                counts.append(chunk)
                budget -= chunk
        return ScheduledBatch(seqs, counts)


class Scheduler:
    """Waiting queue, running list, admission and step planning over one KV pool."""

    def __init__(self, kv_cache: PagedKVCache, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.capacity = CapacityScheduler(kv_cache, config.max_seq_len)
        self.micro_batch = MicroBatchScheduler(config.max_batch_size, config.max_num_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> str | None:
        """Queue ``seq``; return the reason it can never run instead (then it is not queued)."""
        reason = self.capacity.rejection(seq)
        if reason is None:
            self.waiting.append(seq)
        return reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Admit what fits, plan the next step and grow the KV of the chosen requests."""
        self._admit()
        batch = self.micro_batch.plan(self.running)
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            if self.kv_cache.holds(seq.request_id):
                self.kv_cache.extend(seq.request_id, count)
            else:
                self.kv_cache.allocate(seq.request_id, count)
        return batch

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch_size:
            if not self.capacity.try_admit(self.waiting[0]):
                break
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues and free its KV blocks (idempotent)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.capacity.release(seq)

    def drain(self) -> list[Sequence]:
        """Remove and return every queued and running request, freeing their blocks."""
        seqs = [*self.running, *self.waiting]
        for seq in seqs:
            self.finish(seq)
        return seqs
