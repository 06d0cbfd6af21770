"""The native backend's CUDA graphs: the memory profiling sets aside for them, estimated from one
eager step of each model's largest bucket on its probe executor, and the warmup stage's capture
on the final pools, with the memory it really took read from the device."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from bootstrap.backends.artifacts import Warmup
from bootstrap.capacity import CapacityPlan
from bootstrap.devices import Device
from bootstrap.engine.executor.py_executor import PyExecutor
from bootstrap.engine.step.graphs import capture_reserve_bytes
from bootstrap.engine.step.model_runner import ModelRunner
from bootstrap.pipeline.undo import Undo


def reserve_bytes(
    executors: Mapping[str, PyExecutor], sizes: Mapping[str, Sequence[int]], return_cached: Callable[[], None]
) -> int:
    """Device memory the warmup stage's graphs will take (the target's, and the draft's when
    there is one), from one eager step of each one's largest bucket (``capture_reserve_bytes``):
    capturing every bucket here to measure it would double the capture time of a cold start.
    The warmup stage measures what the capture really took next to this reserve."""
    reserve = 0
    for name, executor in executors.items():  # the caller returned the cache just before
        reserve += capture_reserve_bytes(executor.runner, sizes[name])[0]
        return_cached()
    return reserve


def capture(
    runners: Mapping[str, ModelRunner],
    sizes: Mapping[str, Sequence[int]],
    plan: CapacityPlan,
    device: Device,
    return_cached: Callable[[], None],
    settle: Callable[[], None],
    undo: Undo,
) -> Warmup:
    """Each runner's steps captured for its ``sizes`` (every width bucket); released through
    ``undo``. The handle: the runners by name."""

    def release() -> None:
        for runner in runners.values():
            runner.release_graphs()
        settle()

    undo.push(release)
    return_cached()  # the bytes the capture took: in use after less before, cache emptied on both sides
    before = device.total_bytes() - device.free_bytes()
    captures = {name: runner.capture_decode_graphs(sizes[name]) for name, runner in runners.items()}
    return_cached()
    used = max(device.total_bytes() - device.free_bytes() - before, 0)
    target = captures["target"]
    return Warmup(
        dict(runners),
        target.batch_sizes,
        target.widths,
        sum(c.num_graphs for c in captures.values()),
        used,
        plan.graph_bytes,
        sum(c.seconds for c in captures.values()),
    )
