"""Scheduling in two layers, as TensorRT-LLM splits it; ``Scheduler`` holds the queues and ties
the two to the KV cache.

``CapacityScheduler`` admits with the guaranteed-no-evict policy: a request starts only when the
blocks of its whole life fit in what the running requests have not reserved (in both pools with a
draft), first come, first served. ``MicroBatchScheduler`` picks one step's tokens: a token for
every request in decode, then prefill chunks up to ``max_num_tokens``. The ``n`` choices of a
prompt are one request until its prefill ends (``Sequence.forks``, the prompt's full blocks
counted once), then forked (``fork``). With ``prefix_caching`` an admitted request starts after
the longest cached prefix of its prompt (the shorter run of both pools with a draft; its last
prompt token always computed), its reservation unchanged; each step first registers the blocks
completed since (``publish``), and a request that ends registers its own before they are freed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from bootstrap.config import is_int
from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.request.prefix_hash import extend_hashes
from bootstrap.engine.request.prompts import length_problem
from bootstrap.engine.request.sequence import Sequence, SequenceStatus
from bootstrap.engine.step.batch import ScheduledBatch


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 32
    max_num_tokens: int = 2048
    max_seq_len: int = 2048
    prefix_caching: bool = False
    overlap: bool = False  # launch each step before the last one's tokens are read (``executor.overlap``)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("prefix_caching", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SchedulerConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_batch_size > self.max_num_tokens:
            raise ValueError(
                f"SchedulerConfig.max_batch_size ({self.max_batch_size}) must be <= max_num_tokens "
                f"({self.max_num_tokens}): every request in a step needs at least one token"
            )


class CapacityScheduler:
    """Guaranteed-no-evict admission over one KV pool; see the module docstring."""

    def __init__(self, kv_cache: PagedKVCache, max_seq_len: int, draft_kv: PagedKVCache | None = None) -> None:
        self.kv_cache = kv_cache
        self.max_seq_len = max_seq_len
        self.pools = [kv_cache] if draft_kv is None else [kv_cache, draft_kv]
        if draft_kv is not None and draft_kv.tokens_per_block != kv_cache.tokens_per_block:
            raise ValueError(
                f"the draft pool's blocks ({draft_kv.tokens_per_block} tokens) must be the target's "
                f"({kv_cache.tokens_per_block})"
            )
        self.num_blocks = min(pool.num_blocks for pool in self.pools)  # what a reservation must fit in, in each pool
        self._reserved: dict[int, int] = {}

    @property
    def reserved_blocks(self) -> int:
        return sum(self._reserved.values())

    def _life_blocks(self, seq: Sequence) -> int:
        return self.kv_cache.blocks_needed(seq.max_kv_tokens)

    def rejection(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never run with this pool and limit, or None if it can."""
        problem = length_problem(seq.num_prompt_tokens, seq.params.max_tokens, self.max_seq_len)
        if problem is not None:
            return problem
        need = self.blocks_of(seq)
        if need > self.num_blocks:
            choices = f" for its {1 + len(seq.forks)} choices" if seq.forks else ""
            return (
                f"the request needs {need} KV blocks{choices} ({seq.max_kv_tokens} tokens each) but the whole pool "
                f"has {self.num_blocks} blocks of {self.kv_cache.tokens_per_block} tokens"
            )
        return None

    def blocks_of(self, seq: Sequence) -> int:
        """Blocks of ``seq``'s whole life and of its live forks', the prompt's full blocks once."""
        return self._life_blocks(seq) + sum(not c.finished for c in seq.forks) * self.fork_blocks(seq)

    def fork_blocks(self, seq: Sequence) -> int:
        """Blocks a fork of ``seq`` adds over its life: all but the prompt's full blocks, which it shares."""
        return self._life_blocks(seq) - seq.num_prompt_tokens // self.kv_cache.tokens_per_block

    def try_admit(self, seq: Sequence) -> bool:
        """Reserve the blocks of ``seq``'s whole life (and its forks') if they are free; True on success."""
        need = self.blocks_of(seq)
        if self.reserved_blocks + need > self.num_blocks:
            return False
        self._reserved[seq.request_id] = need
        return True

    def hand_over(self, parent: Sequence, child: Sequence) -> None:
        """Move a fork's share of ``parent``'s reservation to the fork itself."""
        share = self.fork_blocks(parent)
        self._reserved[parent.request_id] -= share
        self._reserved[child.request_id] = share

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s reservation and return its blocks to the pool (idempotent)."""
        self._reserved.pop(seq.request_id, None)
        for pool in self.pools:
            pool.free(seq.request_id)


class MicroBatchScheduler:
    """Token-budgeted step selection with chunked prefill; see the module docstring."""

    def __init__(self, max_batch_size: int, max_num_tokens: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens

    def plan(self, running: list[Sequence]) -> ScheduledBatch:
        """Decode tokens first, then prefill chunks, within the batch and token limits."""
        decodes = [s for s in running if not s.in_prefill and not s.ends_in_flight][: self.max_batch_size]
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

    def __init__(self, kv_cache: PagedKVCache, config: SchedulerConfig, draft_kv: PagedKVCache | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.draft_kv = draft_kv
        self.capacity = CapacityScheduler(kv_cache, config.max_seq_len, draft_kv)
        self.micro_batch = MicroBatchScheduler(config.max_batch_size, config.max_num_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        for pool in self.capacity.pools:
            pool.clear_cache()  # a new engine trusts no earlier one's keys (new weights keep the pool)
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # and found there

    def add(self, seq: Sequence) -> str | None:
        """Queue ``seq``; return the reason it can never run instead (then it is not queued)."""
        reason = self.rejection(seq)
        if reason is None:
            self.waiting.append(seq)
        return reason

    def rejection(self, seq: Sequence) -> str | None:
        """Why ``seq`` (with its forks) can never run here, or None."""
        if 1 + len(seq.forks) > self.config.max_batch_size:
            return f"n={1 + len(seq.forks)} choices cannot run at once with max_batch_size {self.config.max_batch_size}"
        return self.capacity.rejection(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Admit what fits, plan the next step and grow the KV of the chosen requests."""
        for seq in self.running:
            self._publish(seq)
        self._admit()
        batch = self.micro_batch.plan(self.running)
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            seq.clock.prefill_steps += seq.in_prefill
            if self.kv_cache.holds(seq.request_id):
                self.kv_cache.extend(seq.request_id, count)
            else:
                self.kv_cache.allocate(seq.request_id, count)
        return batch

    def _admit(self) -> None:
        while self.waiting and len(self.running) + 1 + len(self.waiting[0].forks) <= self.config.max_batch_size:
            if not self.capacity.try_admit(self.waiting[0]):
                break
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.clock.scheduled()
            self.running.append(seq)
            if self.config.prefix_caching and not seq.is_warmup:
                self._reuse_prefix(seq)

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start ``seq`` after the longest cached prefix of its prompt, in every pool."""
        tpb = self.kv_cache.tokens_per_block
        digests = extend_hashes(seq.block_digests, seq.prompt_token_ids, tpb, seq.cache_salt)
        usable = digests[: (seq.num_prompt_tokens - 1) // tpb]  # the last prompt token is computed
        found = [pool.match(usable) for pool in self.capacity.pools]
        hit = min(len(blocks) for blocks in found)
        self.prefix_query_tokens += seq.num_prompt_tokens
        self.prefix_hit_tokens += hit * tpb
        if hit:
            for pool, blocks in zip(self.capacity.pools, found):
                pool.allocate(seq.request_id, hit * tpb, prefix=blocks[:hit])
            seq.num_computed = seq.draft_computed = seq.cached_tokens = hit * tpb
            seq.published = seq.draft_published = hit

    def _publish(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks completed since its last call: those of tokens whose keys
        and values are final in each pool (the draft's: those it computed of them too)."""
        if not self.config.prefix_caching or seq.is_warmup or not self.kv_cache.holds(seq.request_id):
            return
        tpb = self.kv_cache.tokens_per_block
        full = min(seq.num_computed, seq.num_tokens) // tpb  # an in-flight token's id is not known yet
        if full > seq.published:
            digests = extend_hashes(seq.block_digests, seq.token_ids[: full * tpb], tpb, seq.cache_salt)
            self.kv_cache.publish(seq.request_id, digests[:full])
            seq.published = full
        if self.draft_kv is not None and self.draft_kv.holds(seq.request_id):
            drafted = min(seq.draft_computed, seq.num_computed, self.draft_kv.num_tokens(seq.request_id)) // tpb
            if drafted > seq.draft_published:
                self.draft_kv.publish(seq.request_id, seq.block_digests[:drafted])
                seq.draft_published = drafted

    def fork(self, batch: ScheduledBatch) -> ScheduledBatch:
        """After the forward of ``batch``: the forks of each request whose prefill it completes
        join the running requests, and the batch, with no tokens of their own; ``rows`` maps
        every sampling request to its logits row (a fork's is its parent's)."""
        sampling = [s for s, samples in zip(batch.seqs, batch.samples()) if samples]
        if not any(s.forks for s in sampling):
            return batch
        seqs, counts, rows = list(batch.seqs), list(batch.num_new_tokens), list(range(len(sampling)))
        joined: list[tuple[Sequence, Sequence]] = []
        try:
            for row, parent in enumerate(sampling):
                count = batch.num_new_tokens[batch.seqs.index(parent)]
                for child in [
                    c for c in parent.forks if not c.finished
                ]:  # a cancelled one's share stays with the parent
                    self.kv_cache.fork(parent.request_id, child.request_id)
                    joined.append((parent, child))
                    if self.draft_kv is not None and self.draft_kv.holds(parent.request_id):
                        self.draft_kv.fork(parent.request_id, child.request_id)
                        child.draft_computed = parent.draft_computed
                    self.capacity.hand_over(parent, child)
                    child.num_computed, child.status = parent.num_computed + count, SequenceStatus.RUNNING
                    child.clock.joined(parent.clock)
                    self.running.append(child)
                    seqs, counts, rows = [*seqs, child], [*counts, 0], [*rows, row]
        except BaseException:
            self._unfork(joined)
            raise
        for parent in sampling:
            parent.forks = []
        return ScheduledBatch(seqs, counts, rows)

    def _unfork(self, joined: list[tuple[Sequence, Sequence]]) -> None:
        """Undo a fork that failed part way: the forks are carried again, as before it (the
        step's failure then ends the parent, and the first of them takes its place)."""
        for _, child in joined:
            if child in self.running:
                self.running.remove(child)
            self.capacity.release(child)
            child.num_computed, child.status = 0, SequenceStatus.WAITING

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues and free its KV blocks (idempotent). Forks it still
        carries go on without it: the first live one is queued first, carrying the rest."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.kv_cache.holds(seq.request_id):
            seq.clock.kv_blocks = len(self.kv_cache.block_table(seq.request_id))
            self._publish(seq)  # its blocks stay cached once freed
        self.capacity.release(seq)
        heirs, seq.forks = [c for c in seq.forks if not c.finished], []
        if heirs:
            heirs[0].forks = heirs[1:]
            self.waiting.appendleft(heirs[0])

    def drain(self) -> list[Sequence]:
        """Remove and return every queued and running request and the forks they carry, freeing their blocks."""
        carried = [c for s in [*self.running, *self.waiting] for c in s.forks if not c.finished]
        for seq in [*self.running, *self.waiting]:
            seq.forks = []
        seqs = [*self.running, *self.waiting, *carried]
        for seq in seqs:
            self.finish(seq)
        return seqs
