"""The engine channel (``bootstrap.engine.executor.channel``) over a real executor on the CPU: the server's client
gets exactly what the executor gives its own callers, one message per engine round, and every
request, id and KV block is accounted for after cancellations, forgotten requests and a close."""

from __future__ import annotations

import asyncio
import random
import threading

import anyio
import anyio.lowlevel
import pytest
from helpers.overlap_workload import frequent_tokens, workload
from helpers.tiny_llama import VOCAB, build_model, make_executor, reference
from helpers.tiny_models import word_tokenizer

from bootstrap.engine import SamplingParams
from bootstrap.engine.executor.channel import messages as m
from bootstrap.engine.executor.channel.client import CLOSED
from bootstrap.engine.executor.channel.local import LocalEngine

CHANNEL_THREADS = ("bootstrap-core", "bootstrap-client")


@pytest.fixture(scope="module")
def model():
    return build_model()


def executor(model, **kwargs):
    ex = make_executor(model, batch=8, num_tokens=64, kv_tokens=1024, tokenizer=word_tokenizer(VOCAB), **kwargs)
    ex.start_worker()
    return ex


def started(model, **kwargs) -> tuple[LocalEngine, object]:
    ex = executor(model, **kwargs)
    return LocalEngine(ex), ex


async def read_all(client, request_id: int) -> list:
    events = []
    while not events or not events[-1].finished:
        events.append(await client.next_event(request_id))
    return events


def rows(events: list) -> tuple:
    """What a request's events say: tokens, text, how it ended, and its logprobs."""
    end = events[-1]
    logprobs = [(e.token_id, round(e.logprob, 4), tuple(i for i, _ in e.top_logprobs)) for e in events if e.logprob]
    tokens = [e.token_id for e in events if e.token_id is not None]
    return tokens, "".join(e.text for e in events), end.finish_reason, end.error, logprobs


def accounted(engine: LocalEngine, ex) -> None:
    """Nothing left anywhere: the client's requests, the core's ids, the executor's handles, KV blocks."""
    assert engine.client.pending() == 0
    assert engine.core._engine_ids == {} and engine.core._ended_early == set()
    assert ex.stats().handles == 0
    assert ex.engine_stats().kv_used_blocks == 0 and ex.engine_stats().running == 0


def test_the_channel_gives_what_the_executor_gives_its_own_callers(model):
    """The overlap workload (greedy, seeded, penalised, logprobs, n choices, stop ids, min_tokens,
    prefix hits) plus stop strings: equal through the channel and straight from the executor."""
    stop = frequent_tokens(model)[0]
    word = word_tokenizer(VOCAB).decode([reference(model, [5, 6, 7, 8], 12)[3]]).strip()  # the 4th token's text
    items = [*workload(7, stop), ([5, 6, 7, 8], SamplingParams(max_tokens=12, stop=(word,)), 1)]
    direct = executor(model, prefix_caching=True)
    expected = []
    for prompt, params, n in items:
        for request_id in direct.enqueue_choices(prompt, params, n):
            expected.append(rows(list(direct.stream(request_id))))
    direct.shutdown()

    engine, ex = started(model, prefix_caching=True)

    async def through_the_channel() -> list:
        client = engine.start()
        ids = [rid for prompt, params, n in items for rid in client.enqueue_choices(prompt, params, n)]
        got = await asyncio.gather(*(read_all(client, rid) for rid in ids))
        engine.close()
        return [rows(events) for events in got]

    got = asyncio.run(through_the_channel())
    accounted(engine, ex)
    ex.shutdown()
    assert got == expected
    assert (len(got[-1][0]), got[-1][2]) == (4, "stop")  # the stop string ended the last one at its 4th token


def test_one_message_carries_a_whole_round(model):
    engine, ex = started(model)
    prompts, max_tokens = [[3, 4, 5], [9, 8, 7, 6, 5], [40, 41], [100, 7, 100, 7], [11, 12, 13], [21, 22]], 20
    forwards, run = [0], ex.runner.run

    def counted(batch, *feed):
        forwards[0] += 1
        return run(batch, *feed)

    ex.runner.run = counted
    rounds, decode = [0], m.decode_round

    def counted_decode(frame):
        rounds[0] += 1
        return decode(frame)

    async def consume() -> list[list[int]]:
        client = engine.start()
        ids = [client.enqueue(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
        got = await asyncio.gather(*(read_all(client, rid) for rid in ids))
        engine.close()
        return [[e.token_id for e in events if e.token_id is not None] for events in got]

    m.decode_round = counted_decode
    try:
        tokens = asyncio.run(consume())
    finally:
        m.decode_round = decode
    ex.shutdown()
    assert tokens == [reference(model, p, max_tokens) for p in prompts]
    assert rounds[0] <= forwards[0] + 1  # a round's events in one message, and the first load
    assert rounds[0] < len(prompts) * max_tokens / 2  # one a token and request would be 120


def test_refusals_and_the_load_reach_the_client(model):
    """Ids no frame carries (past 64 bits) and ids outside the vocabulary are refused by the
    client as the engine words it; a prompt too long for the engine is refused by the engine."""
    engine, ex = started(model)

    async def run() -> tuple:
        client = engine.start()
        before = client.engine_stats()
        huge = [await client.next_event(rid) for rid in client.enqueue_choices([3, 2**70], SamplingParams(), 2)]
        outside = await client.next_event(client.enqueue([VOCAB + 5], SamplingParams(max_tokens=3)))
        too_long = await client.next_event(client.enqueue([3] * 200, SamplingParams(max_tokens=3)))
        await read_all(client, client.enqueue([3, 4, 5], SamplingParams(max_tokens=3)))
        stats = client.engine_stats()
        engine.close()
        return before, huge, outside, too_long, stats

    before, huge, outside, too_long, stats = asyncio.run(run())
    accounted(engine, ex)
    assert before == stats == ex.engine_stats() and stats.kv_total_blocks > 0
    ex.shutdown()
    assert [e.error for e in huge] == [
        f"request rejected: prompt token ids must be integers in [0, {VOCAB}), got [{2**70}]"
    ] * 2
    assert outside.error == f"request rejected: prompt token ids must be integers in [0, {VOCAB}), got [{VOCAB + 5}]"
    assert (
        too_long.finish_reason == "error"
        and too_long.error.startswith("request rejected: ")
        and "200" in too_long.error
    )


def test_cancels_and_forgets_at_random_leave_nothing_behind(model):
    """Requests cancelled or forgotten at random points, some before their first token, some by
    a reader that is itself cancelled mid-wait: each read request ends once, and nothing is left."""
    engine, ex = started(model)
    rng = random.Random(5)

    async def one(client, prompt: list[int], ends: dict) -> None:
        request_id = client.enqueue(prompt, SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.9, seed=1))
        action, after = rng.choice(["read", "cancel", "forget", "timeout"]), rng.randint(0, 6)
        events = []
        if action == "forget" and after == 0:
            client.forget(request_id)
            return
        while not events or not events[-1].finished:
            if action == "timeout" and len(events) == after:
                with anyio.move_on_after(0):  # a wait cancelled before anything came takes nothing
                    events.append(await client.next_event(request_id))
                action = "read"
                continue
            if len(events) == after and action == "cancel":
                client.cancel(request_id)
            if len(events) == after and action == "forget":
                client.forget(request_id)
                return
            events.append(await client.next_event(request_id))
        assert sum(e.finished for e in events) == 1
        ends[events[-1].finish_reason] = ends.get(events[-1].finish_reason, 0) + 1

    async def run() -> dict:
        client, ends = engine.start(), {}
        async with anyio.create_task_group() as tg:
            for _ in range(60):
                tg.start_soon(one, client, [rng.randrange(3, 200) for _ in range(rng.randint(1, 20))], ends)
                await anyio.lowlevel.checkpoint()
        while client.pending():  # forgotten requests end with the engine's next rounds
            await client_round(client)
        engine.close()
        return ends

    ends = asyncio.run(run())
    accounted(engine, ex)
    ex.shutdown()
    assert ends.get("cancelled", 0) > 0 and ends.get("length", 0) > 0


async def client_round(client) -> None:
    """Wait for the engine's next round to reach ``client`` (a request read to its end)."""
    await read_all(client, client.enqueue([3], SamplingParams(max_tokens=1)))


def test_close_ends_every_open_request_and_leaves_no_thread(model):
    engine, ex = started(model)
    gate, run = threading.Event(), ex.runner.run

    def held(batch, *feed):  # the engine's thread waits here: the request stays open
        gate.wait()
        return run(batch, *feed)

    ex.runner.run = held

    async def run_it():
        client = engine.start()
        request_id = client.enqueue([3, 4], SamplingParams(max_tokens=4))
        assert {t.name for t in threading.enumerate()} >= set(CHANNEL_THREADS)
        engine.close()
        event = await client.next_event(request_id)
        with pytest.raises(RuntimeError, match="channel closed"):
            client.enqueue([3], SamplingParams())
        return event

    event = asyncio.run(run_it())
    gate.set()
    ex.shutdown()
    assert (event.finish_reason, event.error) == ("cancelled", CLOSED)
    assert not {t.name for t in threading.enumerate()} & set(CHANNEL_THREADS)


def test_the_client_reads_rounds_on_trio_too(model):
    engine, ex = started(model)

    async def run() -> list[int]:
        client = engine.start()
        events = await read_all(client, client.enqueue([3, 4, 5], SamplingParams(max_tokens=5)))
        engine.close()
        return [e.token_id for e in events if e.token_id is not None]

    tokens = anyio.run(run, backend="trio")
    ex.shutdown()
    assert tokens == reference(model, [3, 4, 5], 5)


def test_silence_counts_only_while_requests_wait_on_the_engine(model):
    """``silent_s``: nothing while no request waits, however long; the seconds since the engine's
    last round while one does (its step held here); nothing again once its final event came."""
    now = [100.0]
    ex = executor(model)
    engine = LocalEngine(ex, clock=lambda: now[0])
    gate, run = threading.Event(), ex.runner.run
    ex.runner.run = lambda batch, *feed: (gate.wait(), run(batch, *feed))[1]

    async def run_it() -> list:
        client = engine.start()
        seen = [client.silent_s()]
        now[0] += 500.0  # idle: no request waits
        seen.append(client.silent_s())
        request_id = client.enqueue([3, 4], SamplingParams(max_tokens=2))
        seen.append(client.silent_s())
        now[0] += 7.0  # its first step is held
        seen.append(client.silent_s())
        gate.set()
        await read_all(client, request_id)
        seen.append(client.silent_s())
        engine.close()
        return seen

    seen = asyncio.run(run_it())
    ex.shutdown()
    assert seen == [(0.0, 0), (0.0, 0), (0.0, 1), (7.0, 1), (0.0, 0)]


def test_a_reader_that_fell_behind_takes_what_came_in_one_wake(model):
    """``next_events``: every event that has come, in order, the final one last, once the reader
    looks again; mixed with ``next_event`` reads, the request's events are the executor's own."""
    engine, ex = started(model)
    prompt, params = [3, 4, 5], SamplingParams(max_tokens=12)
    expected = reference(model, prompt, 12)

    async def behind() -> tuple[list[int], list[int]]:
        client = engine.start()
        request_id = client.enqueue(prompt, params)
        first = await client.next_event(request_id)
        while not any(e.finished for e in client._requests[request_id].events):  # noqa: ASYNC110 (left unread)
            await anyio.sleep(0.01)
        rest = await client.next_events(request_id)
        assert request_id not in client._requests  # gone with its final event
        with pytest.raises(KeyError):
            await client.next_events(request_id)
        engine.close()
        return [e.token_id for e in [first, *rest] if e.token_id is not None], [len(rest), rest[-1].finished]

    tokens, (taken, ended) = asyncio.run(behind())
    accounted(engine, ex)
    ex.shutdown()
    assert tokens == expected and taken == 11 and ended  # the other 11 tokens, the last one final, in one call
