"""Stress test of the executor's async API: many concurrent ``await_response_async`` and
``stream_async`` waits, cancelled at seeded random points (cancel scopes, ``asyncio.wait_for``,
a cancelled stream left unclosed in the middle of its loop), each request waited on again until
it is answered or released (``cancel``, ``cancel_on_abandon``).

Afterwards every request is accounted for exactly once, what was streamed and what was awaited
agree with transformers' greedy output, and nothing is left: no handle, no KV block, no thread,
no CPU spent once the executor is shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import random
import threading
import time
from dataclasses import dataclass, field

import anyio
import pytest
from helpers.tiny_llama import build_model, cpu_seconds_over, make_executor, reference

from bootstrap.engine import Response, SamplingParams, StreamEvent

PROMPTS = [[3, 4, 5], [9, 8, 7, 6, 5], [40, 41], [100, 7, 100, 7, 100, 7]]
MAX_TOKENS = 20
NUM_REQUESTS = 64


@pytest.fixture(scope="module")
def model():
    return build_model()


@pytest.fixture(scope="module")
def expected(model):
    return {tuple(p): reference(model, p, MAX_TOKENS) for p in PROMPTS}


@dataclass
class Ledger:
    """What happened to one request, as its consumer saw it."""

    prompt: list[int]
    max_tokens: int
    streamed: list[StreamEvent] = field(default_factory=list)
    response: Response | None = None
    released: bool = False
    rounds: int = 0

    @property
    def settled(self) -> bool:
        return self.released or self.response is not None or bool(self.streamed and self.streamed[-1].finished)


class Consumer:
    """Waits on one request round after round, each round cut short at a random point, until
    the request is answered or given up."""

    def __init__(self, ex, rid: int, ledger: Ledger, rng: random.Random, backend: str) -> None:
        self.ex, self.rid, self.ledger, self.rng, self.backend = ex, rid, ledger, rng, backend

    async def run(self) -> None:
        while not self.ledger.settled:
            self.ledger.rounds += 1
            pick = self.rng.random()
            if pick < 0.5:
                await self.stream_round()
            elif pick < 0.92:
                await self.await_round()
            elif pick < 0.97:
                await self.abandon_round()
            else:
                self.ex.cancel(self.rid)
                self.ledger.released = True

    def deadline(self) -> float:
        return self.rng.choice([0.0, *(self.rng.uniform(0.0, top) for top in (0.005, 0.05, 0.2))])

    async def stream_round(self) -> None:
        """Stream under a random deadline; sometimes pause in the loop body, so the deadline
        hits while the stream is suspended between events and is dropped unclosed."""
        pause = self.rng.random() < 0.5
        with anyio.move_on_after(self.deadline()):
            async for event in self.ex.stream_async(self.rid):
                self.ledger.streamed.append(event)
                if pause:
                    await anyio.sleep(self.rng.uniform(0, 0.01))

    async def await_round(self) -> None:
        timeout = self.deadline()
        if self.backend == "asyncio" and self.rng.random() < 0.5:
            with contextlib.suppress(TimeoutError):
                self.ledger.response = await asyncio.wait_for(self.ex.await_response_async(self.rid), timeout)
            return
        with anyio.move_on_after(timeout):
            self.ledger.response = await self.ex.await_response_async(self.rid)

    async def abandon_round(self) -> None:
        """A wait that gives the request up if it ends without the response."""
        with anyio.move_on_after(self.deadline()):
            self.ledger.response = await self.ex.await_response_async(self.rid, cancel_on_abandon=True)
        self.ledger.released = self.ledger.response is None


async def consume_all(ex, ledgers: dict[int, Ledger], seed: int, backend: str) -> None:
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for rid, ledger in ledgers.items():
                tg.start_soon(Consumer(ex, rid, ledger, random.Random(seed * 1000 + rid), backend).run)
        if not ex.worker_running:  # no loop runs now: cancel() applies what abandoned waits gave up
            for rid in [rid for rid, ledger in ledgers.items() if ledger.released]:
                ex.cancel(rid)
        # with a worker, given-up requests go at its next round; a poll of its state, bounded by fail_after
        while ex.stats().handles:  # noqa: ASYNC110
            await anyio.sleep(0.01)


def check_outcome(ex, ledgers: dict[int, Ledger], expected) -> None:
    for rid, ledger in ledgers.items():
        tokens = [e.token_id for e in ledger.streamed]
        full = expected[tuple(ledger.prompt)][: ledger.max_tokens]
        if ledger.released:  # whatever was streamed before the release is still right
            assert tokens == full[: len(tokens)]
            with pytest.raises(KeyError, match=f"unknown request id {rid}"):
                ex.await_response(rid, timeout=0)
            continue
        if ledger.response is not None:
            assert ledger.response.token_ids == full and ledger.response.finish_reason == "length"
            assert tokens == full[: len(tokens)]
        else:  # streamed to its end, possibly over several streams: every event exactly once
            assert tokens == full and [e.finished for e in ledger.streamed] == [False] * (len(full) - 1) + [True]


@pytest.mark.parametrize(
    ("backend", "worker", "seed"),
    [
        ("asyncio", True, 1),
        ("asyncio", True, 2),
        pytest.param(
            "trio", True, 3, marks=pytest.mark.skipif(importlib.util.find_spec("trio") is None, reason="needs trio")
        ),
        ("asyncio", False, 4),
    ],
)
def test_randomly_cancelled_async_waits_lose_nothing_and_leave_nothing(model, expected, backend, worker, seed):
    threads_before = set(threading.enumerate())
    ex = make_executor(model, batch=6, num_tokens=48, kv_tokens=512)
    if worker:
        ex.start_worker()
    rng = random.Random(seed)
    ledgers = {}
    for _ in range(NUM_REQUESTS):
        prompt, max_tokens = rng.choice(PROMPTS), rng.randint(1, MAX_TOKENS)
        ledgers[ex.enqueue(prompt, SamplingParams(max_tokens=max_tokens))] = Ledger(prompt, max_tokens)

    anyio.run(consume_all, ex, ledgers, seed, backend, backend=backend)

    check_outcome(ex, ledgers, expected)
    assert sum(ledger.rounds for ledger in ledgers.values()) > 2 * NUM_REQUESTS  # most waits were cut short
    assert any(ledger.released for ledger in ledgers.values())
    assert ex.stats().handles == 0 and ex.runner.kv_cache.stats().used_blocks == 0
    ex.shutdown()
    deadline = time.monotonic() + 10  # anyio's worker threads (no-worker case) end with their event loop
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) <= threads_before
    time.sleep(0.2)
    assert cpu_seconds_over(0.5) < 0.05
