"""``create_executor``: a loaded model and a KV pool wired into a ``PyExecutor`` (its runner,
scheduler and sampler made here)."""

from __future__ import annotations

import torch

from bootstrap.config import DEFAULT_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS, is_int
from bootstrap.engine.executor.py_executor import DEFAULT_MAX_UNCLAIMED, PyExecutor
from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.sampling.sampler import Sampler
from bootstrap.engine.scheduler import Scheduler, SchedulerConfig
from bootstrap.engine.spec.rows import speculative_rows
from bootstrap.engine.spec.speculator import Speculator
from bootstrap.engine.step.model_runner import ModelRunner


def create_executor(
    model: torch.nn.Module,
    kv_cache: PagedKVCache,
    config: SchedulerConfig,
    tokenizer: object | None = None,
    eos_token_ids: set[int] | None = None,
    start: bool = True,
    max_unclaimed: int = DEFAULT_MAX_UNCLAIMED,
    runner: ModelRunner | None = None,
    draft: tuple[torch.nn.Module, PagedKVCache] | ModelRunner | None = None,
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
    adaptive: bool = False,
) -> PyExecutor:
    """Wire a loaded model (switched to paged attention in place) and a KV pool into a
    ``PyExecutor``; its worker is started unless ``start=False``. ``max_unclaimed``: how many
    finished responses nobody waits for are kept (``executor.request_table``). ``runner``: one
    already made for this model and pool (with its CUDA graphs captured, say) instead of a new one.
    ``draft``: a draft model and its pool, or a runner made for them: each decode step proposes
    ``speculative_tokens`` tokens with it (with ``adaptive``, up to that many, as each request's
    acceptance pays for) and verifies them with the target (``bootstrap.engine.spec.speculator``);
    the runners' steps then hold ``speculative_rows`` rows."""
    if draft is not None and (not is_int(speculative_tokens) or not 1 <= speculative_tokens <= MAX_SPECULATIVE_TOKENS):
        raise ValueError(
            f"speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {speculative_tokens!r}"
        )
    rows = speculative_rows(config.max_batch_size, speculative_tokens, adaptive) if draft is not None else (0, 0)
    if runner is None:
        runner = ModelRunner(model, kv_cache, config.max_batch_size, config.max_seq_len, max_rows=rows[0])
    elif runner.model is not model or runner.kv_cache is not kv_cache or runner.max_batch_size < config.max_batch_size:
        raise ValueError("the runner given to create_executor was made for another model, pool or batch size")
    sampler = Sampler(runner.device)
    speculator = None
    if draft is not None:
        if not isinstance(draft, ModelRunner):
            draft = ModelRunner(draft[0], draft[1], config.max_batch_size, config.max_seq_len, max_rows=rows[1])
        if runner.max_rows < rows[0] or draft.max_rows < rows[1] or draft.max_batch_size < config.max_batch_size:
            raise ValueError(
                f"speculating with {speculative_tokens} tokens needs runners of max_rows {rows[0]} (target) "
                f"and {rows[1]} (draft); the ones given have {runner.max_rows} and {draft.max_rows}"
            )
        speculator = Speculator(draft, runner, sampler, speculative_tokens, config.max_seq_len, adaptive)
    scheduler = Scheduler(kv_cache, config, speculator.pool if speculator is not None else None)
    executor = PyExecutor(runner, scheduler, sampler, tokenizer, eos_token_ids, max_unclaimed, speculator)
    if start:
        executor.start_worker()
    return executor
