"""The executor's wakeups of async consumers: a round's new tokens for every request it advanced
reach an event loop as one callback (``RequestTable.wakes_batched``), not one per request and
token; every stream still gets every token, in order."""

from __future__ import annotations

import asyncio

import pytest
from helpers.tiny_llama import build_model, make_executor, reference

from bootstrap.engine import SamplingParams

PROMPTS = [[3, 4, 5], [9, 8, 7, 6, 5], [40, 41], [100, 7, 100, 7], [11, 12, 13], [21, 22]]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def model():
    return build_model()


def test_a_round_wakes_each_event_loop_once_for_all_its_streams(model):
    ex = make_executor(model, batch=8, num_tokens=64, kv_tokens=512)
    rounds = [0]
    step = ex._loop.step

    def counted_step():
        rounds[0] += 1
        step()

    ex._loop.step = counted_step

    async def consume() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        calls, schedule = [0], loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            calls[0] += 1
            return schedule(*args, **kwargs)

        loop.call_soon_threadsafe = counted
        ids = [ex.enqueue(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in PROMPTS]
        ex.start_worker()

        async def stream(rid: int) -> list[int]:
            return [event.token_id async for event in ex.stream_async(rid)]

        tokens = await asyncio.gather(*(stream(rid) for rid in ids))
        return tokens, calls[0]

    tokens, calls = asyncio.run(consume())
    ex.shutdown()
    assert tokens == [reference(model, p, MAX_TOKENS) for p in PROMPTS]
    assert rounds[0] >= MAX_TOKENS
    assert calls <= rounds[0] + len(PROMPTS)  # a round's wakeups in one callback (and a first one each)
    assert calls < len(PROMPTS) * MAX_TOKENS / 2  # one a token and request would be 120
