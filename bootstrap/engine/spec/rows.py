"""The rows a draft model adds: how many each model's steps hold (the verify pass, ``k + 1`` a
request; the draft's first pass, two) and the rows its CUDA graphs are captured for."""

from __future__ import annotations

from collections.abc import Sequence

from bootstrap.capacity.cuda_graph_buckets import speculative_batch_sizes
from bootstrap.config import BootstrapConfig
from bootstrap.engine.spec.depth import ROW_TOKENS


def max_rows(config: BootstrapConfig) -> dict[str, int]:
    """The most rows a step of each model's runner holds: ``max_batch_size``, or with a draft
    the speculative passes' (``speculative_rows``)."""
    if config.draft_model is None:
        return {"target": config.max_batch_size}
    target, draft = speculative_rows(
        config.max_batch_size, config.speculative_tokens, config.num_speculative_tokens == "auto"
    )
    return {"target": target, "draft": draft}


def graph_sizes(config: BootstrapConfig, batch_sizes: Sequence[int]) -> dict[str, list[int]]:
    """The rows each model's graphs are captured for: the decode buckets, and with a draft the
    target's verify passes (``k + 1`` rows a request) and the draft's catching-up first pass
    (two) of as many requests (``speculative_batch_sizes``); with ``auto`` also the draft's
    pass of requests resuming after a pause (``ROW_TOKENS`` rows each; measured much faster
    than that pass eager: benchmarks/README.md, Speculative decoding)."""
    if config.draft_model is None:
        return {"target": list(batch_sizes)}
    draft = speculative_batch_sizes(batch_sizes, 2)
    if config.num_speculative_tokens == "auto":
        draft = sorted({*draft, *speculative_batch_sizes(batch_sizes, ROW_TOKENS)})
    return {"target": speculative_batch_sizes(batch_sizes, config.speculative_tokens + 1), "draft": draft}


def speculative_rows(max_batch_size: int, speculative_tokens: int, adaptive: bool = False) -> tuple[int, int]:
    """The most rows a step holds when speculating: the target's verify pass, ``k + 1`` per
    request; the draft's first pass, two per request (after a full acceptance it catches up on
    the last proposal and the target's token), and with ``adaptive`` (``auto``) ``ROW_TOKENS``,
    so requests resuming after a pause catch up in one pass (logits kept at their last rows
    only, so such a pass needs no more memory than a decode step)."""
    return max_batch_size * (speculative_tokens + 1), max_batch_size * (ROW_TOKENS if adaptive else 2)
