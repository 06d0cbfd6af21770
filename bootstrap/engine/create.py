"""``create_executor``: a loaded model and a KV pool wired into a ``PyExecutor`` (its runner,
scheduler and sampler made here)."""

from __future__ import annotations

import torch

from bootstrap.engine.executor import DEFAULT_MAX_UNCLAIMED, PyExecutor
from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.model_runner import ModelRunner
from bootstrap.engine.sampling import Sampler
from bootstrap.engine.scheduler import Scheduler, SchedulerConfig


def create_executor(
    model: torch.nn.Module,
    kv_cache: PagedKVCache,
    config: SchedulerConfig,
    tokenizer: object | None = None,
    eos_token_ids: set[int] | None = None,
    start: bool = True,
    max_unclaimed: int = DEFAULT_MAX_UNCLAIMED,
    runner: ModelRunner | None = None,
) -> PyExecutor:
    """Wire a loaded model (switched to paged attention in place) and a KV pool into a
    ``PyExecutor``; its worker is started unless ``start=False``. ``max_unclaimed``: how many
    finished responses nobody waits for are kept (see the module docstring). ``runner``: one
    already made for this model and pool (with its CUDA graphs captured, say) instead of a new one."""
    if runner is None:
        runner = ModelRunner(model, kv_cache, config.max_batch_size, config.max_seq_len)
    elif runner.model is not model or runner.kv_cache is not kv_cache or runner.max_batch_size < config.max_batch_size:
        raise ValueError("the runner given to create_executor was made for another model, pool or batch size")
    sampler = Sampler(runner.device)
    executor = PyExecutor(runner, Scheduler(kv_cache, config), sampler, tokenizer, eos_token_ids, max_unclaimed)
    if start:
        executor.start_worker()
    return executor

