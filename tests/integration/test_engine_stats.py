"""``PyExecutor.engine_stats``: what the server's ``/metrics`` reads from the event loop while the
worker steps. It never waits for a step, its figures are consistent with what was enqueued, and
it settles at an empty engine once every request is done (the real engine, on the CPU)."""

from __future__ import annotations

import threading
import time

from helpers.tiny_llama import Throttle, build_model, make_executor

from bootstrap.backends.base import RequestExecutor
from bootstrap.engine import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def stats_once(executor, ready, timeout: float = 30.0):
    """The first stats for which ``ready(stats)`` holds (the test waits for it; the engine never polls)."""
    deadline = time.monotonic() + timeout
    while not ready(stats := executor.engine_stats()):
        assert time.monotonic() < deadline, f"the engine did not get there in time: {stats}"
        time.sleep(0.01)
    return stats


def test_the_executor_meets_the_request_contract():
    executor = make_executor(build_model())
    try:
        assert isinstance(executor, RequestExecutor) and executor.is_running
    finally:
        executor.shutdown()
    assert not executor.is_running


def test_stats_are_read_without_waiting_for_a_step_and_count_every_request():
    executor = make_executor(build_model(), batch=2)
    throttle = Throttle(executor)  # every forward waits for the test: a step is in progress meanwhile
    executor.start_worker()
    try:
        ids = [executor.enqueue(PROMPT, SamplingParams(max_tokens=3)) for _ in range(5)]
        throttle.allow(1)  # one step runs; the worker is then held inside the next one's forward
        held = stats_once(executor, lambda stats: stats.running == 2)
        assert (held.running, held.waiting) == (2, 3)  # read while the worker holds its step lock
        done = threading.Event()
        seen = []

        def read() -> None:  # the event loop's side: another thread, while the worker is held in a forward
            while not done.is_set():
                seen.append(executor.engine_stats())

        reader = threading.Thread(target=read)
        reader.start()
        throttle.open()
        for rid in ids:
            assert executor.await_response(rid, timeout=60).ok
        done.set()
        reader.join(10)
        assert not reader.is_alive() and seen
        for stats in seen:
            assert 0 <= stats.running <= 2 and stats.running + stats.waiting <= len(ids)
            assert 0 <= stats.kv_used_blocks <= stats.kv_total_blocks
        final = executor.engine_stats()
        assert (final.running, final.waiting, final.kv_used_blocks) == (0, 0, 0)
        assert final.kv_capacity_tokens == final.kv_total_blocks * executor.runner.kv_cache.tokens_per_block
    finally:
        executor.shutdown()


def test_a_request_is_counted_out_before_its_answer_wakes_its_waiter():
    executor = make_executor(build_model(), batch=2)
    table, at_answer = executor._requests, []
    publish = table.publish

    def observed(handle, event, response=None):  # the moment a waiter can wake with its answer
        if response is not None:
            at_answer.append(executor.engine_stats())
        publish(handle, event, response)

    table.publish = observed
    executor.start_worker()
    try:
        ids = [executor.enqueue(PROMPT, SamplingParams(max_tokens=n)) for n in (2, 4)]
        assert all(executor.await_response(rid, timeout=60).ok for rid in ids)
        assert [(s.running, s.waiting) for s in at_answer] == [(1, 0), (0, 0)]
    finally:
        executor.shutdown()
