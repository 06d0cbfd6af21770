"""What ``estimation_build`` and ``profiling`` change after an OOM: a smaller probe, and only then a
smaller ``max_num_tokens``, as new inputs (a config copy and ``probe_tokens``); the shared config
is never touched.

The probe is added back to the KV budget, so its size changes no figure of the plan, while
``max_num_tokens`` is recorded in it. So the probe's slack beyond the dummy workload goes first
(the estimation formula's floor of one ``max_seq_len`` request plus a block per batch slot), then
``max_num_tokens`` halves (never below ``max(max_batch_size, 16)``) with the probe sized to its
dummy workload. Every retry differs from the attempt that failed; when nothing can change, the
adaptation raises ``GiveUp`` with the reason, so no attempt is spent repeating a failure.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bootstrap.backends.artifacts import EstimationBuild
from bootstrap.capacity import dummy_workload_tokens
from bootstrap.config import BootstrapConfig
from bootstrap.devices import DeviceOutOfMemory, is_oom
from bootstrap.pipeline.stage import Adaptation, GiveUp


class ProbeOutOfMemory(DeviceOutOfMemory):
    """An OOM while a probe was built or profiled; names the workload and the probe that ran."""

    def __init__(self, cause: BaseException, *, doing: str, max_num_tokens: int, probe_tokens: int) -> None:
        self.max_num_tokens, self.probe_tokens = max_num_tokens, probe_tokens
        super().__init__(
            f"{cause} ({doing} for max_num_tokens={max_num_tokens} with a probe of {probe_tokens:,} tokens)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled whole (message and figures): a peer rank adapts from the same figures."""
        return _probe_oom, (str(self), self.max_num_tokens, self.probe_tokens)


def _probe_oom(message: str, max_num_tokens: int, probe_tokens: int) -> ProbeOutOfMemory:
    exc = ProbeOutOfMemory.__new__(ProbeOutOfMemory)
    DeviceOutOfMemory.__init__(exc, message)
    exc.max_num_tokens, exc.probe_tokens = max_num_tokens, probe_tokens
    return exc


@contextmanager
def probe_oom(doing: str, *, max_num_tokens: int, probe_tokens: int) -> Iterator[None]:
    """Re-raise any OOM inside as a ``ProbeOutOfMemory`` (the original is its cause)."""
    try:
        yield
    except Exception as exc:
        if not is_oom(exc) or isinstance(exc, ProbeOutOfMemory):
            raise
        raise ProbeOutOfMemory(exc, doing=doing, max_num_tokens=max_num_tokens, probe_tokens=probe_tokens) from exc


@dataclass(frozen=True)
class ProbeRun:
    max_num_tokens: int
    probe_tokens: int | None  # None: not known (an OOM raised outside ``probe_oom``)

    def larger_than(self, tokens: int) -> bool:
        return self.probe_tokens is None or self.probe_tokens > tokens


def shrink_probe(exc: BaseException, inputs: Mapping[str, Any]) -> Adaptation:
    """``estimation_build``: a strictly smaller probe. The dummy workload of the same
    ``max_num_tokens`` if smaller than the probe that failed, else ``max_num_tokens`` halved until
    its workload is; ``GiveUp`` when even the floor's workload is not (the probe was capped)."""
    ran, config = _ran(exc, inputs), inputs["config"]
    tokens, workload = ran.max_num_tokens, _workload(ran.max_num_tokens, inputs)
    while not ran.larger_than(workload):
        half = _halved(tokens, config)
        if half is None:
            raise GiveUp(
                f"the probe cannot shrink below its {ran.probe_tokens:,} tokens: max_num_tokens is already {tokens}, "
                f"its floor (max_batch_size, at least 16), whose dummy workload needs {workload:,} tokens; building "
                "the probe and the temporary executor still runs out of memory: lower max_batch_size (the floor, and "
                "the executor state beside the probe) or max_seq_len, lower free_gpu_memory_fraction (it caps the "
                "probe), or free device memory"
            ) from exc
        tokens, workload = half, _workload(half, inputs)
    return _adaptation(ran, ProbeRun(tokens, workload), config)


def shrink_probe_or_workload(exc: BaseException, inputs: Mapping[str, Any]) -> Adaptation:
    """``profiling``: the dummy workload of the same ``max_num_tokens`` if smaller than the probe
    the forward ran beside, else ``max_num_tokens`` halved with its workload's probe; ``GiveUp``
    when ``max_num_tokens`` is at its floor and the probe already is its workload."""
    ran, config = _ran(exc, inputs), inputs["config"]
    workload = _workload(ran.max_num_tokens, inputs)
    if ran.larger_than(workload):
        return _adaptation(ran, ProbeRun(ran.max_num_tokens, workload), config)
    half = _halved(ran.max_num_tokens, config)
    if half is None:
        raise GiveUp(
            f"max_num_tokens is already {ran.max_num_tokens}, its floor (max_batch_size, at least 16), and the "
            f"probe ({ran.probe_tokens:,} tokens) is already no larger than its dummy workload, yet the dummy forward "
            "still runs out of memory; lower max_batch_size or max_seq_len, or free device memory"
        ) from exc
    return _adaptation(ran, ProbeRun(half, _workload(half, inputs)), config)


def effective_max_num_tokens(config: BootstrapConfig, estimation: EstimationBuild | None) -> int:
    """The config's value, or the smaller one the probe was built for after its own retries."""
    probe = estimation.max_num_tokens if estimation is not None else config.max_num_tokens
    return min(config.max_num_tokens, probe)


def _ran(exc: BaseException, inputs: Mapping[str, Any]) -> ProbeRun:
    if isinstance(exc, ProbeOutOfMemory):
        return ProbeRun(exc.max_num_tokens, exc.probe_tokens)
    return ProbeRun(effective_max_num_tokens(inputs["config"], inputs.get("estimation")), None)


def _workload(max_num_tokens: int, inputs: Mapping[str, Any]) -> int:
    tokens_per_block = inputs["config"].tokens_per_block
    return dummy_workload_tokens(
        max_num_tokens=max_num_tokens, max_seq_len=inputs["resolved"].max_seq_len, tokens_per_block=tokens_per_block
    )


def _halved(max_num_tokens: int, config: BootstrapConfig) -> int | None:
    half = max(max_num_tokens // 2, config.max_batch_size, 16)
    return half if half < max_num_tokens else None


def _adaptation(ran: ProbeRun, nxt: ProbeRun, config: BootstrapConfig) -> Adaptation:
    changes = {}
    if nxt.max_num_tokens != ran.max_num_tokens:
        changes["max_num_tokens"] = f"{ran.max_num_tokens} -> {nxt.max_num_tokens}"
    changes["probe_tokens"] = f"{ran.probe_tokens or '?'} -> {nxt.probe_tokens}"
    config = config.model_copy(update={"max_num_tokens": nxt.max_num_tokens})
    return Adaptation({"config": config, "probe_tokens": nxt.probe_tokens}, changes)
