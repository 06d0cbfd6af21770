"""Each row's argmax over a vocabulary, as ``torch.argmax(dim=-1)`` gives it, in two stages.

Greedy decoding takes one argmax a step, speculative decoding one per draft pass and one for the
verify pass, each over a whole vocabulary for a few rows. torch reduces a row shorter than about
2**17 values in one thread block, so its time grows with the vocabulary; past that it spreads a
row over many blocks. Split into ``chunks`` equal pieces, a row is reduced by ``chunks`` blocks
at once (each piece's maximum and its index), then across the pieces' maxima, in about the same
time at any vocabulary. So ``argmax`` splits the vocabularies in ``SPLIT_VOCABS`` for up to
``FEW_ROWS`` rows, where that measured faster, and leaves the rest to ``torch.argmax``
(benchmarks/README.md, "Argmax over a vocabulary"). Same answer as ``torch.argmax``, ties and
NaN included: ``max(dim)`` gives each piece's first maximal index (NaN counting as the largest),
the second stage the first piece holding the row's maximum.
"""

from __future__ import annotations

import functools

import torch

MIN_PIECE = 128  # the fewest values a piece holds
MAX_CHUNKS = 512
SPLIT_VOCABS = range(65_536, 131_072)  # where torch's one block a row is slower than two stages
FEW_ROWS = 8  # up to these many rows (at 32, a 65,536 vocabulary already is not)


def argmax(x: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (long, ``x.shape[:-1]``) for ``x`` of at least one dimension;
    ``chunks`` (a divisor of the last dimension) overrides the choice: ``split`` on CUDA, where
    it was measured; elsewhere no split."""
    size = x.shape[-1]
    if chunks is None:
        chunks = split(size, x[..., 0].numel()) if x.is_cuda else 1
    if size % chunks:
        raise ValueError(f"chunks must divide the last dimension ({size}), got {chunks}")
    if chunks == 1:
        return x.argmax(dim=-1)
    values, within = x.unflatten(-1, (chunks, size // chunks)).max(dim=-1)
    piece = values.argmax(dim=-1, keepdim=True)
    return (piece * (size // chunks) + within.gather(-1, piece)).squeeze(-1)


def split(size: int, rows: int) -> int:
    """The pieces ``argmax`` splits ``rows`` rows of ``size`` values into: 1 (no split) outside
    ``SPLIT_VOCABS`` or past ``FEW_ROWS``."""
    return chunks_for(size) if size in SPLIT_VOCABS and rows <= FEW_ROWS else 1


@functools.cache
def chunks_for(size: int) -> int:
    """The most equal pieces ``size`` splits into, at most ``MAX_CHUNKS``, none under
    ``MIN_PIECE`` values; 1 when there is no such split in two or more."""
    for chunks in range(min(MAX_CHUNKS, size // MIN_PIECE), 1, -1):
        if size % chunks == 0:
            return chunks
    return 1
