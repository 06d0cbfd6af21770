"""What a draft model adds to the native backend's stages: how many rows each model's steps hold
(the verify pass, ``k + 1`` a request; the draft's first pass, two), the rows its CUDA graphs
are captured for, and profiling's dummy speculative step on the probe executors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bootstrap.capacity.cuda_graph_buckets import speculative_batch_sizes
from bootstrap.config import BootstrapConfig
from bootstrap.engine.create import speculative_rows
from bootstrap.engine.executor import PyExecutor
from bootstrap.engine.profile_run import run_dummy_speculation
from bootstrap.engine.sampling import Sampler
from bootstrap.engine.speculation import Speculator
from bootstrap.engine.speculative import ROW_TOKENS


def max_rows(config: BootstrapConfig) -> dict[str, int]:
    """The most rows a step of each model's runner holds: ``max_batch_size``, or with a draft
    the speculative passes' (``speculative_rows``)."""
    if config.draft_model is None:
        return {"target": config.max_batch_size}
    target, draft = speculative_rows(config.max_batch_size, config.speculative_tokens, config.num_speculative_tokens == "auto")
    return {"target": target, "draft": draft}


def graph_sizes(config: BootstrapConfig, batch_sizes: Sequence[int]) -> dict[str, list[int]]:
    """The rows each model's graphs are captured for: the decode buckets, and with a draft the
    target's verify passes (``k + 1`` rows a request) and the draft's catching-up first pass
    (two) of as many requests (``speculative_batch_sizes``); with ``auto`` also the draft's
    pass of requests resuming after a pause (``ROW_TOKENS`` rows each: with that pass eager, a
    probe step at batch 8 on the H200 took 16.0 ms, through these graphs 7.7)."""
    if config.draft_model is None:
        return {"target": list(batch_sizes)}
    draft = speculative_batch_sizes(batch_sizes, 2)
    if config.num_speculative_tokens == "auto":
        draft = sorted({*draft, *speculative_batch_sizes(batch_sizes, ROW_TOKENS)})
    return {"target": speculative_batch_sizes(batch_sizes, config.speculative_tokens + 1), "draft": draft}


def rehearse_speculation(executors: Mapping[str, PyExecutor], config: BootstrapConfig, max_seq_len: int) -> None:
    """Profiling: one speculative step of ``max_batch_size`` sampled dummy requests at full depth
    over the probe executors' runners (``run_dummy_speculation``), so the peak includes it."""
    target, draft = executors["target"].runner, executors["draft"].runner
    speculator = Speculator(draft, target, Sampler(target.device), config.speculative_tokens, max_seq_len)
    run_dummy_speculation(speculator, config.max_batch_size)
