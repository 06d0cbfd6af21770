"""The profiling loop: dummy requests through an executor's own scheduler, runner and sampler.

The serving loop (``PyExecutor``) is fault tolerant: a step that raises is run again request by
request, so one bad request cannot fail its neighbours. Profiling needs the opposite: the peak
of a *whole* ``max_num_tokens`` step is the measurement, and a step that runs out of memory must
fail the run (so the stage can adapt and retry), not quietly succeed in smaller pieces. This
loop drives the same scheduler, model runner and sampler in the calling thread, lets any error
propagate, and takes every dummy out of the scheduler (freeing its blocks) either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq

from bootstrap.config import BootstrapConfig
from bootstrap.engine.executor.py_executor import PyExecutor
from bootstrap.engine.request.sequence import Sequence, next_request_id
from bootstrap.engine.sampling.sampler import Sampler, SamplingParams
from bootstrap.engine.spec.speculator import Speculator

# Sampled rows take the heaviest sampling path (softmax, top-k, top-p over the vocabulary).
DUMMY_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, ignore_eos=True)


def run_dummy_requests(executor: PyExecutor, lengths: Seq[int]) -> int:
    """Prompts of ``lengths`` tokens, one sampled token each, to completion; the number of steps.

    Must not run while the executor's worker runs (the probe executor has none).
    """
    if executor.worker_running:
        raise RuntimeError("dummy requests need an executor without a running worker")
    scheduler, vocab = executor.scheduler, executor.runner.vocab_size
    seqs = [Sequence(next_request_id(), [t % vocab for t in range(n)], DUMMY_PARAMS, is_warmup=True) for n in lengths]
    try:
        for seq in seqs:
            reason = scheduler.add(seq)
            if reason is not None:
                raise ValueError(f"a profiling dummy of {seq.num_prompt_tokens} tokens cannot run: {reason}")
        steps = 0
        while scheduler.has_work:
            _step(executor)
            steps += 1
        return steps
    finally:
        scheduler.drain()


def _step(executor: PyExecutor) -> None:
    batch = executor.scheduler.schedule()
    logits = executor.runner.run(batch)
    sampling = [seq for seq, samples in zip(batch.seqs, batch.samples()) if samples]
    if sampling:
        executor.sampler.sample(logits, [s.params for s in sampling], [None] * len(sampling))
    for seq, count in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed += count
    for seq in sampling:  # max_tokens is 1: a request that sampled is done
        executor.scheduler.finish(seq)


def run_dummy_speculation(speculator: Speculator, batch_size: int) -> None:
    """One speculative step of ``batch_size`` sampled dummy requests at full depth
    (``Speculator.rehearse``): the draft's passes, the verify pass and the judging over the
    draft's and the target's distributions. Both pools must hold no request."""
    for pool in (speculator.pool, speculator.target.kv_cache):
        if pool.stats().used_blocks:
            raise RuntimeError("a dummy speculative step needs empty pools (its rows write block 0)")
    speculator.rehearse([Sequence(next_request_id(), [0], DUMMY_PARAMS, is_warmup=True) for _ in range(batch_size)])


def rehearse_speculation(executors: Mapping[str, PyExecutor], config: BootstrapConfig, max_seq_len: int) -> None:
    """Profiling: one speculative step of ``max_batch_size`` sampled dummy requests at full depth
    over the probe executors' runners (``run_dummy_speculation``), so the peak includes it."""
    target, draft = executors["target"].runner, executors["draft"].runner
    speculator = Speculator(draft, target, Sampler(target.device), config.speculative_tokens, max_seq_len)
    run_dummy_speculation(speculator, config.max_batch_size)
