"""Request handles of the executor: cancelled waits lose nothing, one consumer per request,
bounded retention, nothing left running or spinning after ``shutdown``.

A ``Throttle`` holds the model before each forward, so a wait is cancelled at a known point
(before the first token, between two tokens) instead of whenever the machine happens to be.
"""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest
from helpers.tiny_llama import Throttle, build_model, cpu_seconds_over, make_executor, reference

from bootstrap.engine import RequestInUse, SamplingParams

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def model():
    return build_model()


@pytest.fixture
def held(model):
    """A started executor whose model waits for the test's ``Throttle``; shut down at the end."""
    ex = make_executor(model)
    throttle = Throttle(ex)
    ex.start_worker()
    yield ex, throttle
    throttle.open()
    ex.shutdown()


async def test_a_timed_out_async_await_leaves_the_response_for_the_next_await(model, held):
    ex, throttle = held
    rid = ex.enqueue(PROMPT, SamplingParams(max_tokens=4))
    await _until(lambda: ex.runner.kv_cache.stats().used_blocks > 0)  # admitted, held before its prefill
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(ex.await_response_async(rid), 0.05)
    throttle.open()
    await _until(lambda: ex.runner.kv_cache.stats().used_blocks == 0)  # finished
    await anyio.sleep(0.1)  # time for anything left of the cancelled wait to act
    with anyio.fail_after(10):
        response = await ex.await_response_async(rid, 10)
    assert response.token_ids == reference(model, PROMPT, 4)
    assert ex.stats().handles == 0


async def test_a_cancelled_async_stream_leaves_every_event_for_the_next_stream(model, held):
    ex, throttle = held
    rid = ex.enqueue(PROMPT, SamplingParams(max_tokens=6))
    throttle.allow(2)  # prefill and one decode: two tokens
    seen = []
    with anyio.move_on_after(0.3):
        async for event in ex.stream_async(rid):
            seen.append(event)  # the third token is held back: cancelled while waiting for it
    assert len(seen) == 2
    throttle.allow(1)  # the third token comes while nobody streams
    with anyio.move_on_after(0.05):  # cancelled before it reads anything
        async for event in ex.stream_async(rid):
            seen.append(event)
            await anyio.sleep(1)
    throttle.open()
    with anyio.fail_after(10):
        seen += [event async for event in ex.stream_async(rid)]
    assert [e.token_id for e in seen] == reference(model, PROMPT, 6)
    assert [e.finished for e in seen] == [False] * 5 + [True]
    assert ex.stats().handles == 0


async def test_a_stream_cancelled_before_the_only_token_leaves_it_for_the_next_stream(model, held):
    ex, throttle = held
    rid = ex.enqueue(PROMPT, SamplingParams(max_tokens=1))
    for _ in range(5):
        with anyio.move_on_after(0.02):
            async for _event in ex.stream_async(rid):
                pass
    throttle.open()
    with anyio.fail_after(10):
        events = [event async for event in ex.stream_async(rid)]
    assert [(e.token_id, e.finish_reason) for e in events] == [(reference(model, PROMPT, 1)[0], "length")]


async def test_a_second_consumer_of_a_request_gets_a_clear_error(held):
    ex, throttle = held
    rid = ex.enqueue(PROMPT, SamplingParams(max_tokens=3))
    first = ex.stream_async(rid)
    throttle.allow(1)
    with anyio.fail_after(10):
        assert (await first.__anext__()).token_id is not None
        with pytest.raises(RequestInUse, match=f"request {rid} is already .* stream_async"):
            await ex.stream_async(rid).__anext__()
        with pytest.raises(RequestInUse, match=f"request {rid}"):
            await ex.await_response_async(rid)
        with pytest.raises(RequestInUse, match=f"request {rid}"):
            ex.await_response(rid, timeout=0)
    throttle.open()
    with anyio.fail_after(10):
        rest = [event async for event in first]
    assert [e.finished for e in rest] == [False, True]


def test_two_threads_streaming_one_request_do_not_split_its_events(model, held):
    ex, throttle = held
    rid = ex.enqueue(PROMPT, SamplingParams(max_tokens=5))
    results: dict[str, object] = {}

    def consume(name: str) -> None:
        try:
            results[name] = [e.token_id for e in ex.stream(rid)]
        except RequestInUse as exc:
            results[name] = exc

    threads = [threading.Thread(target=consume, args=(name,)) for name in "ab"]
    for t in threads:
        t.start()
    throttle.open()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    outcomes = sorted(results.values(), key=lambda r: isinstance(r, RequestInUse))
    assert outcomes[0] == reference(model, PROMPT, 5)
    assert isinstance(outcomes[1], RequestInUse) and "already being consumed" in str(outcomes[1])


async def test_cancel_on_abandon_releases_the_request(held):
    ex, throttle = held
    rid = ex.enqueue(PROMPT, SamplingParams(max_tokens=50))
    with anyio.move_on_after(0.05):
        await ex.await_response_async(rid, cancel_on_abandon=True)
    with pytest.raises(KeyError, match=f"unknown request id {rid}"):
        await ex.await_response_async(rid)
    streamed = ex.enqueue(PROMPT, SamplingParams(max_tokens=50))
    with anyio.move_on_after(0.05):
        async for _event in ex.stream_async(streamed, cancel_on_abandon=True):
            pass
    with pytest.raises(KeyError, match=f"unknown request id {streamed}"):
        ex.await_response(streamed)
    throttle.open()
    await _until(lambda: ex.stats().handles == 0)
    assert ex.scheduler.kv_cache.stats().used_blocks == 0


async def test_without_a_worker_an_abandoned_wait_is_cancelled_when_the_loop_next_runs(model):
    ex = make_executor(model)
    rid = ex.enqueue(PROMPT, SamplingParams(max_tokens=100))
    with anyio.move_on_after(0.05):  # steps run in a thread meanwhile; the one under way ends first
        await ex.await_response_async(rid, cancel_on_abandon=True)
    assert ex.runner.kv_cache.stats().used_blocks > 0 and not ex.worker_running
    with pytest.raises(KeyError, match=f"unknown request id {rid}"):
        await ex.await_response_async(rid)
    [other] = ex.generate([PROMPT], SamplingParams(max_tokens=1))  # the loop runs again
    assert other.ok and ex.stats().handles == 0 and ex.runner.kv_cache.stats().used_blocks == 0
    ex.shutdown()


async def _until(condition) -> None:
    """Poll ``condition`` for up to 10 s: it reads state the executor's worker thread changes,
    which has no event to wait on."""
    with anyio.fail_after(10.0):
        while not condition():  # noqa: ASYNC110 -- a poll of the worker thread's state, bounded above
            await anyio.sleep(0.01)


async def test_no_thread_and_no_cpu_left_after_shutdown_with_cancelled_waits(model):
    before = set(threading.enumerate())
    ex = make_executor(model)
    throttle = Throttle(ex)
    ex.start_worker()
    rids = [ex.enqueue(PROMPT, SamplingParams(max_tokens=3)) for _ in range(3)]
    for rid in rids:
        with anyio.move_on_after(0.02):
            async for _event in ex.stream_async(rid):
                pass
        with anyio.move_on_after(0.02):
            await ex.await_response_async(rid)
    throttle.open()
    ex.shutdown()
    assert set(threading.enumerate()) <= before
    assert cpu_seconds_over(0.5) < 0.1
    for rid in rids:
        with anyio.fail_after(5):
            assert (await ex.await_response_async(rid)).finish_reason in ("length", "cancelled")


def test_generate_checks_every_prompt_before_enqueuing_any(model):
    ex = make_executor(model)
    with pytest.raises(TypeError, match="prompt_token_ids must be a sequence of token ids, got str"):
        ex.generate([PROMPT, PROMPT, "oops"])
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        ex.generate([PROMPT, PROMPT], [SamplingParams(), {"max_tokens": 2}])
    assert ex.stats().handles == 0
    [only] = ex.generate([PROMPT], SamplingParams(max_tokens=2))
    assert only.token_ids == reference(model, PROMPT, 2)
    assert ex.stats().handles == 0 and ex.runner.kv_cache.stats().used_blocks == 0
    ex.shutdown()


def test_cancelled_requests_nobody_awaits_are_released(model):
    ex = make_executor(model)
    ex.start_worker()
    for _ in range(100):
        ex.cancel(ex.enqueue(PROMPT, SamplingParams(max_tokens=20)))
    ex.generate([PROMPT], SamplingParams(max_tokens=1))  # runs after every cancel was taken
    stats = ex.stats()
    assert (stats.handles, stats.unfinished) == (0, 0)
    assert ex.runner.kv_cache.stats().used_blocks == 0
    done = ex.enqueue(PROMPT, SamplingParams(max_tokens=1))
    ex.generate([PROMPT], SamplingParams(max_tokens=1))
    ex.cancel(done)  # finished and unclaimed: cancel releases it too
    assert ex.stats().handles == 0
    with pytest.raises(KeyError, match=f"unknown request id {done}"):
        ex.await_response(done)
    ex.shutdown()


def test_unclaimed_responses_are_kept_up_to_a_bound(model):
    ex = make_executor(model, max_unclaimed=3)
    ids = [ex.enqueue([i + 1, i + 2], SamplingParams(max_tokens=2)) for i in range(8)]
    ex.generate([PROMPT], SamplingParams(max_tokens=1))  # drives the loop until all eight are done
    assert ex.stats().handles == 3
    for rid in ids[:5]:
        with pytest.raises(KeyError, match=f"unknown request id {rid}"):
            ex.await_response(rid)
    kept = [ex.await_response(rid).token_ids for rid in ids[5:]]
    assert kept == [reference(model, [i + 1, i + 2], 2) for i in range(5, 8)]
    assert ex.stats().handles == 0
    ex.shutdown()


def test_a_finished_request_someone_is_attached_to_is_never_dropped_for_the_bound(model):
    ex = make_executor(model, max_unclaimed=1)
    ex.start_worker()
    first = ex.enqueue(PROMPT, SamplingParams(max_tokens=2))
    stream = ex.stream(first)
    head = next(stream)  # attached from here on; it finishes while its final event waits
    others = [ex.enqueue(PROMPT, SamplingParams(max_tokens=1)) for _ in range(4)]
    assert ex.await_response(others[-1], timeout=10).ok
    assert ex.stats().unclaimed <= 1  # three of the others finished unclaimed: at most one is kept
    tail = list(stream)
    assert [head.token_id, *(e.token_id for e in tail)] == reference(model, PROMPT, 2)
    assert ex.stats().handles == ex.stats().unclaimed <= 1  # ``first`` went with its final event
    ex.shutdown()


def test_a_tiny_top_p_keeps_the_most_likely_token(model):
    ex = make_executor(model)
    [response] = ex.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-46))
    assert response.token_ids == reference(model, PROMPT, 6)
    ex.shutdown()
