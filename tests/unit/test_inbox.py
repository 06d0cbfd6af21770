"""The inbox between callers and the engine loop: everything posted reaches the scheduler once,
in order, except requests that finished (were cancelled) while queued; wake-up calls carry none."""

from __future__ import annotations

import threading

import torch

from bootstrap.engine.executor.inbox import Inbox
from bootstrap.engine.kv_cache import KVCacheSpec, PagedKVCache
from bootstrap.engine.request.sequence import Sequence, next_request_id
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.engine.scheduler import Scheduler, SchedulerConfig


def scheduler() -> Scheduler:
    pool = PagedKVCache(KVCacheSpec(1, 1, 4, torch.float32), num_blocks=16, tokens_per_block=4, device="cpu")
    return Scheduler(pool, SchedulerConfig(4, 16, 16))


def request() -> Sequence:
    return Sequence(next_request_id(), [1, 2], SamplingParams(max_tokens=2))


def test_posted_requests_reach_the_scheduler_in_order_and_cancelled_ones_do_not():
    inbox, sched = Inbox(), scheduler()
    kept, cancelled, first = request(), request(), request()
    cancelled.finish("cancelled")
    for item in (kept, None, cancelled):
        inbox.post(item)
    assert inbox.drain_into(sched, first) is True
    assert list(sched.waiting) == [first, kept]
    assert inbox.drain_into(sched) is False and list(sched.waiting) == [first, kept]  # nothing twice


def test_wait_sleeps_until_something_is_posted():
    inbox, seq = Inbox(), request()
    got: list[Sequence | None] = []
    waiter = threading.Thread(target=lambda: got.append(inbox.wait()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and got == []  # asleep: nothing posted yet
    inbox.post(seq)
    waiter.join(5)
    assert got == [seq]
