"""A step's inputs on the host, decided once and run anywhere: ``MixedStep`` (any step, from a
scheduled batch), ``RowsStep`` (one-token rows) and ``BlockCopy`` (a fork's partial blocks).

Each holds only ids, positions, slots, block tables and lengths (host lists and CPU tensors), so
the rank that scheduled a step can send it to the ranks that run the same forward on their own
shard and pool (``ModelRunner.follow``): the block ids are valid in every rank's pool, which
has the same geometry. ``model`` names the runner (``target``, or a speculator's ``draft``);
a ``RowsStep`` whose ids or position moves are on the device (a draft's proposals) gives their
shapes, and the tensors follow it (``ModelRunner.lead``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.step.batch import ScheduledBatch
from bootstrap.engine.step.decode_step import DecodeStep


@dataclass(frozen=True)
class GroupRows:
    """One attention group's requests: padded block tables and ``[context, query, start]``
    lengths per request (``layers.attention.AttentionGroup`` on the host)."""

    tables: torch.Tensor  # [b, W] long
    lengths: torch.Tensor  # [3, b] long: context lengths, query lengths, query starts
    max_query_len: int
    fresh: bool

    @property
    def num_tokens(self) -> int:
        return int(self.lengths[1].sum())


@dataclass(frozen=True)
class MixedStep:
    """Prefill chunks and decode tokens of several requests, flattened into one row."""

    rows: torch.Tensor  # [2, T] long: ids, positions
    slots: torch.Tensor  # [T] long
    keep: torch.Tensor  # [S] long: the flat index of each sampling request's last token
    groups: tuple[GroupRows, ...]
    model: str = "target"


@dataclass(frozen=True)
class RowsStep:
    """A step of one-token rows (``DecodeStep``) and the rows whose logits are wanted."""

    step: DecodeStep
    keep: tuple[int, ...] | None = None
    tokens: tuple[int, ...] | None = None  # the shape of the ids on the device that follow
    offsets: int | None = None  # the length of the position moves on the device that follow
    model: str = "target"


@dataclass(frozen=True)
class BlockCopy:
    """Blocks copied whole, ``sources[i]`` into ``copies[i]`` (a fork's partial last blocks)."""

    sources: tuple[int, ...]
    copies: tuple[int, ...]
    model: str = "target"


def describe(batch: ScheduledBatch, kv_cache: PagedKVCache, model: str = "target") -> MixedStep:
    """The host inputs of ``batch``: its new tokens back to back, their slots, and the groups
    to attend. Groups: one-token queries; prompt chunks with nothing cached before them (fresh:
    they attend their own keys); continued chunks of a prompt longer than a step (they gather
    their cached context; the scheduler splits at most one prompt per step). A group alone
    covers every token, in order."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[torch.Tensor] = []
    for seq, count in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed
        known = seq.token_ids[start : start + count]
        ids += known + [0] * (count - len(known))  # tokens in flight: the runner's feed puts them in
        positions += range(start, start + count)
        slots.append(kv_cache.slots(seq.request_id, start, start + count))
    counts = torch.tensor(batch.num_new_tokens, dtype=torch.long)
    keep = (torch.cumsum(counts, 0) - 1)[torch.tensor(batch.samples(), dtype=torch.bool)]
    rows = torch.tensor([ids, positions], dtype=torch.long)
    groups = tuple(_group(batch, m, kv_cache) for m in _members(batch))
    return MixedStep(rows, torch.cat(slots), keep, groups, model)


def _members(batch: ScheduledBatch) -> list[list[int]]:
    kinds: dict[str, list[int]] = {"short": [], "fresh": [], "continued": []}
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        kinds["short" if n == 1 else "fresh" if seq.num_computed == 0 else "continued"].append(i)
    groups = [members for members in kinds.values() if members]
    return [list(range(len(batch.seqs)))] if len(groups) == 1 else groups


def _group(batch: ScheduledBatch, members: Sequence[int], kv_cache: PagedKVCache) -> GroupRows:
    starts = [0, *itertools.accumulate(batch.num_new_tokens)][:-1]
    tables = [kv_cache.block_table(batch.seqs[i].request_id) for i in members]
    width = max(len(t) for t in tables)
    counts = [batch.num_new_tokens[i] for i in members]
    lengths = [
        [batch.seqs[i].num_computed + batch.num_new_tokens[i] for i in members],
        counts,
        [starts[i] for i in members],
    ]
    return GroupRows(
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
        torch.tensor(lengths, dtype=torch.long),
        max(counts),
        all(batch.seqs[i].num_computed == 0 for i in members),
    )
