"""A workload that crosses every feature overlap scheduling touches (greedy, seeded, penalised
and logprob requests, ``n`` choices, stop ids, EOS, ``min_tokens``, prefix hits), run on an
executor with half its requests arriving while the others decode; the CPU and CUDA tests of
``SchedulerConfig.overlap`` compare its outcome with and without overlap."""

from __future__ import annotations

import random
from collections import Counter

from bootstrap.engine import SamplingParams
from helpers.tiny_llama import reference


def prompts_of(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(2, 30))] for _ in range(12)]


def frequent_tokens(model) -> list[int]:
    """The two tokens the model's greedy answers hold most often: an EOS and a stop id that end requests."""
    counts = Counter(t for seed in (1, 2, 3) for p in prompts_of(seed) for t in reference(model, p, 10))
    return [token for token, _ in counts.most_common(2)]


def workload(seed: int, stop: int) -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt, params, n) of requests that cross every feature the overlap touches."""
    prompts = prompts_of(seed)
    shared = prompts[0][:2] + [11] * 16  # a prefix that fills whole blocks, for the prefix cache
    kinds = [
        SamplingParams(max_tokens=9, temperature=0),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=6, logprobs=3),
        SamplingParams(max_tokens=11, temperature=0, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,), min_tokens=2),
        SamplingParams(max_tokens=14, temperature=0.7, seed=9, presence_penalty=0.5),
        SamplingParams(max_tokens=6, temperature=0, logprobs=0),
        SamplingParams(max_tokens=13, temperature=0.9, seed=3, ignore_eos=True),
    ]
    out = [(p, kinds[i % len(kinds)], 1) for i, p in enumerate(prompts)]
    out += [([*shared, 5, 6], kinds[1], 3), ([*shared, 8], kinds[0], 2), (shared, kinds[4], 1)]
    return out


def run_workload(ex, seed: int, stop: int) -> tuple[list, int]:
    """Every response of the workload on ``ex`` (its worker not started), half enqueued up front
    and half one by one as the engine steps (so prompts prefill beside decodes), as (tokens,
    finish, error, logprobs) rows, and the number of forwards run; nothing left afterwards."""
    forwards = [0]
    run = ex.runner.run

    def counted(batch, *feed):
        forwards[0] += 1
        return run(batch, *feed)

    ex.runner.run = counted
    items, ids = workload(seed, stop), []
    for prompt, params, n in items[: len(items) // 2]:
        ids += ex.enqueue_choices(prompt, params, n)
    for prompt, params, n in items[len(items) // 2 :]:
        ex._loop.step_here()  # a round as the executor's waits run it
        ids += ex.enqueue_choices(prompt, params, n)
    answers = [ex.await_response(rid, timeout=60) for rid in ids]
    assert ex.stats().handles == 0 and ex.runner.kv_cache.stats().used_blocks == 0
    assert all(not s.in_flight for s in ex.scheduler.running) and ex._loop.in_flight is None
    ex.shutdown()
    rows = [
        (a.token_ids, a.finish_reason, a.error, [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs or []])
        for a in answers
    ]
    return rows, forwards[0]


def assert_same_outcome(got: list, want: list, tolerance: float = 1e-4) -> None:
    """The same tokens, finishes and errors; each token's logprob within ``tolerance``, and its
    alternatives the same up to ties: in order, where values differ by more than ``tolerance``
    (other batches round otherwise; bfloat16 ties often, and tied ids may come in either order,
    or one may take the other's place at the end of the list)."""
    import pytest

    assert [r[:3] for r in got] == [r[:3] for r in want]
    for g, w in zip(got, want):
        assert [t for t, _, _ in g[3]] == [t for t, _, _ in w[3]]
        assert [lp for _, lp, _ in g[3]] == pytest.approx([lp for _, lp, _ in w[3]], abs=tolerance)
        for (_, _, got_top), (_, _, want_top) in zip(g[3], w[3]):
            assert_same_up_to_ties(got_top, want_top, tolerance)


def assert_same_up_to_ties(got: list, want: list, tolerance: float) -> None:
    """Two top-k lists of (id, logprob), best first: the same values within ``tolerance``; an id in
    one only is tied (within ``tolerance``) with the other's last; a shared id has one value."""
    import pytest

    assert len(got) == len(want)
    assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=tolerance)
    got_values, want_values = dict(got), dict(want)
    for i in got_values.keys() & want_values.keys():
        assert got_values[i] == pytest.approx(want_values[i], abs=tolerance), i
    for i in got_values.keys() - want_values.keys():
        assert got_values[i] == pytest.approx(want[-1][1], abs=tolerance), i
    for i in want_values.keys() - got_values.keys():
        assert want_values[i] == pytest.approx(got[-1][1], abs=tolerance), i
