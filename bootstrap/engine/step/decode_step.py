"""One decode step's inputs: ``DecodeStep`` on the host, ``DecodeBuffers`` on the device (the
fixed-shape tensors a CUDA graph replays from), and ``DecodeRunner``, what capturing graphs
needs from a model runner (``ModelRunner`` is one).

A row is one token at its own position, attending its request's cache up to that position. A
plain decode step has one row per request; speculative decoding's verify pass gives a request
one row per token it scores (its last token and the draft's proposals, at consecutive
positions), and so can a draft pass that catches up on two tokens: every layer writes the
step's keys and values before it attends, so each row sees the rows of its request before it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from bootstrap.engine.kv_cache import PagedKVCache


@dataclass
class DecodeStep:
    """One decode step's values on the host: a token, position, slot and block table per row
    (several rows may belong to one request, at consecutive positions)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]

    @classmethod
    def dummy(cls, rows: int) -> DecodeStep:
        """``rows`` rows of token 0 at position 0, all writing slot 0 of block 0 (graph capture
        and profiling, on a pool that holds no request)."""
        return cls([0] * rows, [0] * rows, [0] * rows, [[0]] * rows)

    @property
    def size(self) -> int:
        return len(self.ids)

    @property
    def width(self) -> int:
        """Block-table columns the step needs: the longest table."""
        return max(len(table) for table in self.tables)


class DecodeBuffers:
    """Preallocated, fixed-shape inputs of a decode step (one token per row).

    Five rows of ``max_rows`` (ids, positions, slots, context lengths, write rows) and the
    block tables, on the device. On CUDA they are filled from pinned host buffers with
    asynchronous copies, so filling a step never waits for the GPU; the host buffers are
    rewritten only once the previous step's copies have finished (a recorded event).
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int, tokens_per_block: int, device: torch.device) -> None:
        self.max_rows, self.max_blocks_per_seq, self.tokens_per_block = max_rows, max_blocks_per_seq, tokens_per_block
        pinned = device.type == "cuda"
        self.rows = torch.zeros(5, max_rows, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.write_rows = self.rows
        self.query_lens = torch.ones(max_rows, dtype=torch.long, device=device)
        self.logits_index = torch.arange(max_rows, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.long, device=device)
        self._host_rows = torch.zeros(5, max_rows, dtype=torch.long, pin_memory=pinned)
        self._host_tables = torch.zeros(max_rows * max_blocks_per_seq, dtype=torch.long, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None

    def fill(
        self,
        step: DecodeStep,
        rows: int | None = None,
        width: int | None = None,
        tokens: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> int:
        """Copy ``step`` into the first ``rows`` rows and ``width`` block-table columns (default:
        the step's own size and width); return the step's size. ``tokens``: ids on the device in
        place of ``step.ids`` (a draft's proposals, which the host does not know without waiting
        for the device): ``[size]`` for every row, or ``[R, m]`` for the last ``m`` rows of each
        of ``R`` equal groups (a verify pass: each request's proposals after its own last token).
        ``offsets``: ``[size]`` on the device, added to the rows' positions, their slots and
        context lengths then derived on the device from the block tables (rows placed after a
        verdict the host has not read yet: the draft's pass queued behind a verify pass).

        Rows past the step's size repeat its last row (a padded CUDA-graph replay); columns past
        a table's length hold block 0, which lies past the row's length and is masked out.
        Columns past ``width`` keep older block ids, equally valid and equally masked.
        """
        size = step.size
        rows, width = rows or size, width or step.width
        if not size <= rows <= self.max_rows or not step.width <= width <= self.max_blocks_per_seq:
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
        if tokens is not None:  # after the copy above, on the same stream; padding rows keep the host's
            ids = self.input_ids[:size]  # ids, and write their real row's keys (write_rows)
            (ids if tokens.dim() == 1 else ids.view(tokens.shape[0], -1)[:, -tokens.shape[1] :]).copy_(tokens)
        if offsets is not None:
            self._shift(offsets, size, rows)
        if self._copied is not None:
            self._copied.record()
        return size

    def _shift(self, offsets: torch.Tensor, size: int, rows: int) -> None:
        """Move rows ``:rows`` by ``offsets`` (padding rows by their real row's), on the device."""
        moved = offsets.to(self.positions.dtype).index_select(0, self.write_rows[:rows])
        positions = self.positions[:rows].add_(moved)
        torch.add(positions, 1, out=self.context_lens[:rows])
        per_block = self.tokens_per_block
        blocks = self.block_tables[:rows].gather(1, (positions // per_block)[:, None])[:, 0]
        torch.add(blocks * per_block, positions % per_block, out=self.slot_mapping[:rows])


def request_runs(rows: list[tuple[int, int, int]]) -> list[tuple[int, int, list[int]]]:
    """Rows ``(request id, position, token)`` as ``token_rows`` takes them: a run of consecutive
    positions per request."""
    runs: list[tuple[int, int, list[int]]] = []
    for request_id, position, token in rows:
        if runs and runs[-1][0] == request_id and runs[-1][1] + len(runs[-1][2]) == position:
            runs[-1][2].append(token)
        else:
            runs.append((request_id, position, [token]))
    return runs


def queued_tensor(device: torch.device, values: list[int]) -> torch.Tensor:
    """A small int64 tensor on ``device`` without waiting for it: a plain ``.to("cuda")`` of a
    host tensor waits for the stream to drain, which would idle the device while the host
    prepares the next pass; from pinned memory the copy is queued like a kernel."""
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class DecodeRunner(Protocol):
    """What ``DecodeGraphs`` reads and calls on the runner whose decode steps it captures."""

    model: torch.nn.Module
    kv_cache: PagedKVCache
    device: torch.device
    max_rows: int
    max_blocks_per_seq: int
    vocab_size: int
    decode_buffers: DecodeBuffers

    def forward_decode(self, rows: int, width: int) -> torch.Tensor: ...

    def default_widths(self) -> list[int]: ...
