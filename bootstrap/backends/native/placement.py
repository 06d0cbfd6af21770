"""Where the native backend runs: the device ``config.device`` names, and with tensor parallelism
this process's rank (set by the launcher) and its device. Raises ``ConfigError`` naming the field
and what is allowed, before anything is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import CpuDevice, CudaDevice, Device

if TYPE_CHECKING:
    from bootstrap.parallel.rank_env import RankEnv


def device_for(spec: str) -> tuple[Device, torch.device]:
    """The memory port and torch device ``config.device`` names; a clear error when absent."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return CpuDevice(), torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device: {spec!r} asked for, but torch sees no CUDA device; allowed here: auto, cpu")
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"device: {spec!r} does not exist; allowed: cuda:0..cuda:{count - 1}, cuda, cpu, auto")
    return CudaDevice(index), torch.device("cuda", index)


def rank_env(config: BootstrapConfig) -> RankEnv:
    """This rank's place, as the launcher set it; a clear error when none did."""
    from bootstrap.parallel.rank_env import RankEnv

    env = RankEnv.from_env()
    tp = config.tensor_parallel_size
    if env is None or env.world_size != tp:
        found = "no RANK / WORLD_SIZE" if env is None else f"WORLD_SIZE {env.world_size}"
        raise ConfigError(
            f"tensor_parallel_size: {tp} needs {tp} ranks, and this process has {found}; start it with "
            f"`bootstrap run --tp {tp}` (which launches the ranks) or `torchrun --nproc-per-node {tp}`"
        )
    return env


def rank_device(spec: str, local_rank: int) -> str:
    """One device per rank: ``cuda:LOCAL_RANK`` for ``auto`` / ``cuda`` on a CUDA machine."""
    if spec.startswith("cuda:"):
        raise ConfigError(
            f"device: {spec!r} with tensor parallelism; allowed: auto, cuda, cpu (rank r takes cuda:LOCAL_RANK)"
        )
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return f"cuda:{local_rank}"
