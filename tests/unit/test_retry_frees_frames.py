"""What a failed attempt's frames still hold (activations, after an out-of-memory error in a
forward) is freed before the next attempt runs, and after a stage fails for good."""

from __future__ import annotations

import gc
import weakref

import pytest

from bootstrap.devices import DeviceOutOfMemory, FakeDevice
from bootstrap.pipeline import Pipeline, StageFailed
from bootstrap.pipeline.stage import Stage, on_oom


class Activation:
    """Stands for a tensor a forward allocated before it ran out of memory."""


def forward(alive: list[weakref.ref], fail_first: int):
    def layer() -> None:
        hidden = Activation()  # a local of a frame the error passes through
        alive.append(weakref.ref(hidden))
        if len(alive) <= fail_first:
            raise DeviceOutOfMemory("out of memory in the forward")

    def profiling(seed: int) -> int:
        if alive:  # every earlier attempt's activation is gone by now
            gc.collect()
            assert [ref() for ref in alive] == [None] * len(alive)
        layer()
        return seed

    return profiling


async def test_a_retry_starts_without_the_failed_attempts_activations():
    alive: list[weakref.ref] = []
    pipeline = Pipeline(
        [Stage("profiling", forward(alive, 2), "profile", retry=on_oom(3))], {"seed": 1}, device=FakeDevice(total=1000)
    )
    assert (await pipeline.run())["profile"] == 1 and len(alive) == 3
    await pipeline.aclose()


async def test_a_stage_that_gives_up_keeps_its_error_but_not_the_activations():
    alive: list[weakref.ref] = []
    pipeline = Pipeline(
        [Stage("profiling", forward(alive, 5), "profile", retry=on_oom(2))], {"seed": 1}, device=FakeDevice(total=1000)
    )
    with pytest.raises(StageFailed) as info:
        await pipeline.run()
    gc.collect()
    assert [ref() for ref in alive] == [None, None]
    assert "out of memory in the forward" in str(info.value) and info.value.cause.__traceback__ is not None
    await pipeline.aclose()
