"""Twenty swaps of a live server while clients stream and hang up at random points (seeded):
every swap succeeds, and afterwards every request is accounted for: each answer the clients got
is counted once in ``/metrics``, nothing is left in flight in the server or in any executor the
swaps released, and no thread is left behind (the app in process: ``helpers.live_serve``)."""

from __future__ import annotations

import random
import threading

import anyio
from helpers.live_serve import BOUND_S, Stream, serving
from helpers.serve_process import metric, metric_or_0

SWAPS = 20
CLIENTS = 3


async def received(stream: Stream, count: int) -> int:
    """Up to ``count`` more events of ``stream``; fewer when it ended (a 503 is one JSON body)."""
    got = 0
    with anyio.fail_after(BOUND_S):
        while got < count:
            try:
                await stream._events.receive()
            except anyio.EndOfStream:
                break
            got += 1
    return got


def own_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("bootstrap")}


async def test_twenty_swaps_under_streaming_traffic_account_for_every_request(llama, qwen):
    seen = {"answered": 0, "refused": 0}
    executors = []
    async with serving(llama, model_id="live", drain_timeout_s=0.0) as server:
        threads = own_threads()
        stop = anyio.Event()

        async def client(seed: int) -> None:
            pick = random.Random(seed)
            while not stop.is_set():
                stream = Stream(server.app, server.completion("live", max_tokens=pick.randint(1, 8)))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream.run)
                    chunks = await received(stream, 1)  # the answer's status is known from here on
                    seen["answered" if stream.status == 200 else "refused"] += 1
                    hang_up_after = pick.choice([0, 1, 2, None])  # chunks more, or the whole answer
                    if chunks and hang_up_after is not None:
                        await received(stream, hang_up_after)
                        tg.cancel_scope.cancel()  # the client hangs up mid-answer

        async with anyio.create_task_group() as traffic:
            for seed in range(CLIENTS):
                traffic.start_soon(client, seed)
            for cycle in range(SWAPS):
                executors.append(server.state.boot.executor)
                body = {"model": str(qwen if cycle % 2 == 0 else llama), "served_model_name": "live"}
                swapped = await server.op("/v1/bootstrap/swap", body)
                assert swapped.status_code == 200, swapped.text
            stop.set()
        page = (await server.http.get("/metrics")).text
        counted = sum(
            metric_or_0(page, "bootstrap_requests_total", endpoint="completion", finish_reason=reason)
            for reason in ("length", "stop", "abort", "error")
        )
        assert len(server.state.inflight) == 0 and metric(page, "bootstrap_requests_in_flight") == 0
        assert counted == seen["answered"], (counted, seen)
        assert seen["answered"] > SWAPS  # traffic ran between the swaps
        for old in executors:
            stats = old.engine_stats()
            assert not old.is_running and (stats.running, stats.waiting, stats.kv_used_blocks) == (0, 0, 0)
        assert f'bootstrap_operations_total{{name="swap",outcome="ok"}} {SWAPS}.0' in page
        assert own_threads() == threads
