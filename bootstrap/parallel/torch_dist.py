"""The ``Collective`` port over torch.distributed, and the process group of a rank.

A rank learns who it is from the launcher's contract (``rank_env``): ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` (set by ``torchrun``, or by ``bootstrap run --tp N`` for the ranks it starts),
with ``MASTER_ADDR`` / ``MASTER_PORT`` for the rendezvous. The model's collectives run on the
default group (NCCL on CUDA, gloo on the CPU); the pipeline's agreements run on a separate gloo
group, on the CPU in both cases, each preceded by a ``monitored_barrier`` so that a rank which
stopped answering is named. Every group has the same timeout: no collective waits forever.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bootstrap.parallel.rank_env import RankEnv
from bootstrap.pipeline.collective import RankUnresponsive

DEFAULT_TIMEOUT_S = 600.0


class TorchCollective:
    """``all_gather`` of picklable values on a gloo group, behind a monitored barrier."""

    def __init__(self, timeout_s: float) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._timeout = timedelta(seconds=timeout_s)
        self._group = dist.new_group(backend="gloo", timeout=self._timeout)

    def all_gather(self, value: Any, what: str) -> list[Any]:
        try:
            dist.monitored_barrier(group=self._group, timeout=self._timeout, wait_all_ranks=True)
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, value, group=self._group)
        except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
            raise RankUnresponsive(self.silent_ranks(str(exc)), f"{what} on rank {self.rank}", first_line(exc)) from exc
        return gathered

    def silent_ranks(self, message: str) -> list[int]:
        """Which ranks did not answer: rank 0 monitors the barrier and names them; the others
        wait on rank 0 alone, so it is rank 0 they lost."""
        named = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
        if named:
            return [int(r) for r in re.findall(r"\d+", named.group(1))]
        if self.rank != 0:
            return [0]
        return list(range(1, self.world_size))


def first_line(exc: BaseException) -> str:
    """A collective's error in one line (its first, at most 300 characters) for a message."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def init_ranks(env: RankEnv, device_kind: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> TorchCollective:
    """Join the default process group (NCCL for CUDA, else gloo) and make the agreement group."""
    if not dist.is_initialized():
        if device_kind == "cuda":
            torch.cuda.set_device(env.local_rank)
        backend = "nccl" if device_kind == "cuda" else "gloo"
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    return TorchCollective(timeout_s)


def leave_ranks() -> None:
    """Destroy every process group this process joined (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
