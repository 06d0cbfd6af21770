"""The one-off stages of a live server's operations (``bootstrap.api.operations``): run by
``Pipeline.run_stage`` beside the graph, with the same spans, retries, rollback and events.

``check_checkpoint``: a swap's new model checked from its files' headers before the drain;
``check_weights`` and ``read_weights`` take new weights into the serving model in place;
``offload_weights`` and ``restore_weights`` move them to host memory and back (sleep level 1);
``check_room``, on wake, plans a smaller KV pool when less device memory is free than the plan
needs, so a wake never meets an OOM later (``docs/serving.md#live-operations``).
"""

from __future__ import annotations

import dataclasses
import logging
import math

from bootstrap.backends.artifacts import HostWeights, LoadedModel, ResolvedClasses, RoomCheck, WeightsPlan
from bootstrap.backends.base import Backend, ChecksCheckpoints, Sleeps, TakesWeights
from bootstrap.capacity import CapacityPlan, MemoryProfile, fmt_bytes
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.pipeline.stage import RetryPolicy, Stage, is_transient_io
from bootstrap.pipeline.undo import Undo
from bootstrap.stages.capacity import capacity

log = logging.getLogger(__name__)


def check_checkpoint(config: BootstrapConfig, resolved: ResolvedClasses, backend: Backend) -> bool:
    """Whether the backend checked the model's files (their headers, no weight read)."""
    if not isinstance(backend, ChecksCheckpoints):
        return False
    backend.check_checkpoints(config, resolved)
    return True


def check_weights(loaded: LoadedModel, path: str, backend: Backend) -> WeightsPlan:
    if not isinstance(backend, TakesWeights):
        raise ConfigError(f"path: the {backend.name} backend cannot take new weights in place; swap the model instead")
    return backend.plan_weights(loaded, path)


def read_weights(weights_plan: WeightsPlan, backend: TakesWeights) -> int:
    return backend.read_weights(weights_plan)


def offload_weights(loaded: LoadedModel, host_weights: HostWeights | None, backend: Backend, undo: Undo) -> HostWeights:
    if not isinstance(backend, Sleeps):
        raise ConfigError(f"level: the {backend.name} backend cannot keep weights in host memory; allowed: 2")
    return backend.offload_weights(loaded, host_weights, undo)


def restore_weights(host_weights: HostWeights, backend: Sleeps) -> int:
    return backend.restore_weights(host_weights)


def check_room(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    profile: MemoryProfile,
    plan: CapacityPlan,
    backend: Backend,
) -> RoomCheck:
    """Free device memory now (the weights back) against the plan's KV budget, graph reserve and
    the rest of the measured peak; short of it, the plan of ``capacity`` with that much less of
    the device counted (``total_bytes``), said in the log."""
    needed = max(profile.torch_peak_bytes - profile.probe_kv_bytes - loaded.weight_bytes, 0)
    needed += profile.graph_bytes + plan.kv_budget_bytes
    free = backend.device.free_bytes()
    if free >= needed:
        return RoomCheck(free, needed)
    short = needed - free
    # under the fraction rule the budget shrinks by that fraction of what is taken away
    taken = short if plan.headroom_bytes is not None else math.ceil(short / plan.fraction)
    smaller = capacity(config, resolved, dataclasses.replace(profile, total_bytes=profile.total_bytes - taken), backend)
    log.warning(
        "wake: %s free, %s short of the plan's %s; the KV pool is planned again: %s tokens instead of %s",
        fmt_bytes(free),
        fmt_bytes(short),
        fmt_bytes(needed),
        smaller.kv_tokens,
        plan.kv_tokens,
    )
    return RoomCheck(free, needed, smaller)


def _room_figures(room: RoomCheck) -> dict[str, int | str]:
    figures: dict[str, int | str] = {"bootstrap.room.free_bytes": room.free_bytes}
    figures["bootstrap.room.needed_bytes"] = room.needed_bytes
    if room.plan is not None:
        figures["bootstrap.kv.budget_bytes"] = room.plan.kv_budget_bytes
        figures["bootstrap.kv.max_tokens"] = room.plan.kv_tokens
    return figures


CHECK_CHECKPOINT = Stage(
    "check_checkpoint",
    check_checkpoint,
    provides="checkpoint_checked",
    figures=lambda c: {"bootstrap.checkpoint.checked": str(c).lower()},
)
CHECK_WEIGHTS = Stage(
    "check_weights",
    check_weights,
    provides="weights_plan",
    figures=lambda p: {"bootstrap.weights.bytes": p.nbytes, "bootstrap.weights.path": p.path},
)
READ_WEIGHTS = Stage(
    "read_weights",
    read_weights,
    provides="weights_read",
    retry=RetryPolicy(attempts=3, retry_on=is_transient_io, backoff_s=0.5),
    figures=lambda n: {"bootstrap.weights.read_bytes": n},
)
OFFLOAD_WEIGHTS = Stage(
    "offload_weights",
    offload_weights,
    provides="host_weights",
    oom_advice="Host memory cannot hold the weights: sleep at level 2 (the weights are read again on wake).",
    figures=lambda h: {"bootstrap.weights.host_bytes": h.nbytes, "bootstrap.weights.pinned": str(h.pinned).lower()},
)
RESTORE_WEIGHTS = Stage(
    "restore_weights",
    restore_weights,
    provides="weights_restored",
    oom_advice="The weights no longer fit: something else took the device while asleep; free it and retry.",
    figures=lambda n: {"bootstrap.weights.restored_bytes": n},
)
CHECK_ROOM = Stage("check_room", check_room, provides="room", figures=_room_figures)
