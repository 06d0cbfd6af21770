"""One decode step's inputs: ``DecodeStep`` on the host, ``DecodeBuffers`` on the device (the
fixed-shape tensors a CUDA graph replays from), and ``DecodeRunner``, what capturing graphs
needs from a model runner (``ModelRunner`` is one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from bootstrap.engine.kv_cache import PagedKVCache


@dataclass
class DecodeStep:
    """One decode step's values on the host: a token, position, slot and block table per row."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def width(self) -> int:
        """Block-table columns the step needs: the longest table."""
        return max(len(table) for table in self.tables)


class DecodeBuffers:
    """Preallocated, fixed-shape inputs of a decode step (one token per request).

    Five rows of ``max_batch_size`` (ids, positions, slots, context lengths, write rows) and the
    block tables, on the device. On CUDA they are filled from pinned host buffers with
    asynchronous copies, so filling a step never waits for the GPU; the host buffers are
    rewritten only once the previous step's copies have finished (a recorded event).
    """

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_batch_size, self.max_blocks_per_seq = max_batch_size, max_blocks_per_seq
        pinned = device.type == "cuda"
        self.rows = torch.zeros(5, max_batch_size, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.write_rows = self.rows
        self.query_lens = torch.ones(max_batch_size, dtype=torch.long, device=device)
        self.logits_index = torch.arange(max_batch_size, device=device)
        self.block_tables = torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.long, device=device)
        self._host_rows = torch.zeros(5, max_batch_size, dtype=torch.long, pin_memory=pinned)
        self._host_tables = torch.zeros(max_batch_size * max_blocks_per_seq, dtype=torch.long, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None

    def fill(self, step: DecodeStep, rows: int | None = None, width: int | None = None) -> int:
        """Copy ``step`` into the first ``rows`` rows and ``width`` block-table columns (default:
        the step's own size and width); return the step's size.

        Rows past the step's size repeat its last row (a padded CUDA-graph replay); columns past
        a table's length hold block 0, which lies past the row's length and is masked out.
        Columns past ``width`` keep older block ids, equally valid and equally masked.
        """
        size = step.size
        rows, width = rows or size, width or step.width
        if not size <= rows <= self.max_batch_size or not step.width <= width <= self.max_blocks_per_seq:
            raise ValueError(f"a decode step of {size} rows and {step.width} blocks does not fit {rows} x {width}")
        pad = rows - size
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        ids, positions, slots = (values + values[-1:] * pad for values in (step.ids, step.positions, step.slots))
        context_lens = [p + 1 for p in positions]
        write_rows = list(range(size)) + [size - 1] * pad
        self._host_rows[:, :rows] = torch.tensor([ids, positions, slots, context_lens, write_rows], dtype=torch.long)
        tables = [table + [0] * (width - len(table)) for table in step.tables]
        host_tables = self._host_tables[: rows * width].view(rows, width)
        host_tables.copy_(torch.tensor(tables + tables[-1:] * pad, dtype=torch.long))
        self.rows.copy_(self._host_rows, non_blocking=True)
        self.block_tables[:rows, :width].copy_(host_tables, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return size


class DecodeRunner(Protocol):
    """What ``DecodeGraphs`` reads and calls on the runner whose decode steps it captures."""

    model: torch.nn.Module
    kv_cache: PagedKVCache
    device: torch.device
    max_batch_size: int
    max_blocks_per_seq: int
    vocab_size: int
    decode_buffers: DecodeBuffers

    def forward_decode(self, rows: int, width: int) -> torch.Tensor: ...

    def default_widths(self) -> list[int]: ...
