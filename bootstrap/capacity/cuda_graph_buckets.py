"""CUDA-graph buckets, pure (no torch): which batch sizes and block-table widths are captured.

``bootstrap.engine.step.graphs`` captures one decode graph per (batch size, width) bucket; the
stages choose the batch sizes (and fewer of them after an out-of-memory error) with these
functions, so planning and the CLI need no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

CUDA_GRAPH_MAX_SEQ_LEN = 8192  # widest captured context, in tokens (vLLM's max_seq_len_to_capture)
CUDA_GRAPH_MIN_SEQ_LEN = 256  # narrowest captured context, in tokens
SPECULATIVE_GRAPH_MAX_ROWS = 512  # most rows of a captured verify or draft pass (vLLM's max_capture_size)


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to and including ``max_batch_size``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size] + list(range(8, max_batch_size, 8))
    return sorted({*sizes, max_batch_size})


def graph_batch_sizes(max_batch_size: int, configured: Sequence[int] | None) -> list[int]:
    """The configured batch sizes (sorted, unique), or the defaults for ``max_batch_size``."""
    return sorted(set(configured)) if configured else default_batch_sizes(max_batch_size)


def speculative_batch_sizes(batch_sizes: Sequence[int], rows_per_request: int) -> list[int]:
    """A speculating model's graph rows: each decode bucket, and that many requests' rows of a
    pass where each has ``rows_per_request`` (the target's verify pass: ``k + 1``; the draft's
    first pass, which may catch up on two tokens: 2), up to ``SPECULATIVE_GRAPH_MAX_ROWS``. A
    pass of fewer proposals (``auto``, a request near its end) replays the next bucket up."""
    more = (b * rows_per_request for b in batch_sizes if b * rows_per_request <= SPECULATIVE_GRAPH_MAX_ROWS)
    return sorted({*batch_sizes, *more})


def decode_widths(max_blocks: int, tokens_per_block: int, max_tokens: int = CUDA_GRAPH_MAX_SEQ_LEN) -> list[int]:
    """Block-table widths to capture: doubling from ``CUDA_GRAPH_MIN_SEQ_LEN`` tokens' worth of
    blocks up to the blocks of ``min(max_seq_len, max_tokens)`` (``max_blocks`` is max_seq_len's)."""
    limit = min(max_blocks, -(-max_tokens // tokens_per_block))
    width, widths = max(-(-CUDA_GRAPH_MIN_SEQ_LEN // tokens_per_block), 1), []
    while width < limit:
        widths.append(width)
        width *= 2
    return [*widths, limit]


def fewer_batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    """The smaller half of ``batch_sizes`` (at least one): what a capture retries with after an
    OOM. Steps larger than the largest one left run eagerly."""
    sizes = sorted(batch_sizes)
    return sizes[: max(len(sizes) // 2, 1)]
