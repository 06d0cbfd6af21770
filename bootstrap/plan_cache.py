"""Plan cache: a measured memory profile, stored under a fingerprint of everything it depends on.

A later start with the same fingerprint skips ``estimation_build`` and ``profiling`` when the
device has room for the plan now: free memory covers the activation peak plus the KV budget.
It never demands equality with a fluctuating figure such as free memory at the last start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from bootstrap.artifacts import ResolvedClasses
from bootstrap.capacity import CapacityPlan, MemoryProfile
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.devices import Device

if TYPE_CHECKING:
    from bootstrap.backends.base import Backend

# Config fields that change the profile or the plan; the rest (plan_cache, device spelling) do not.
FINGERPRINT_FIELDS = (
    "dtype", "kv_cache_dtype", "max_batch_size", "max_num_tokens", "max_seq_len", "tokens_per_block",
    "free_gpu_memory_fraction", "max_kv_bytes", "max_kv_tokens", "host_cache_bytes",
    "cross_kv_cache_fraction", "tensor_parallel_size", "backend", "kv_manager",
)  # fmt: skip
LIBRARIES = ("executor-bootstrap", "torch", "transformers", "tensorrt-llm")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def fingerprint(config: BootstrapConfig, resolved: ResolvedClasses, device: Device, backend: str) -> str:
    parts = {
        "model": resolved.shape.fingerprint(),
        "draft": resolved.draft_shape.fingerprint() if resolved.draft_shape else None,
        "resolved_dtype": [resolved.dtype, resolved.kv_dtype, resolved.max_seq_len],
        "device": [device.name, device.total_bytes()],
        "backend": backend,
        "libraries": {d: _version(d) for d in LIBRARIES},
        "config": {f: getattr(config, f) for f in FINGERPRINT_FIELDS},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class CachedPlan:
    profile: MemoryProfile
    kv_budget_bytes: int

    def needed_after_load(self, weight_bytes: int) -> int:
        """Bytes a start needs once ``weight_bytes`` of weights are loaded: the rest of the
        measured torch peak (executor state, activations) less the probe, plus the KV budget.

        Memory outside torch (CUDA context, other processes) is left out: free memory read after
        the load has already paid for it. At ``free_gpu_memory_fraction`` 1.0 on the same device
        this equals the free memory of the original start, so an identical start still fits.
        """
        p = self.profile
        return max(p.torch_peak_bytes - p.probe_kv_bytes - weight_bytes, 0) + self.kv_budget_bytes

    def fits(self, free_bytes: int, weight_bytes: int) -> bool:
        return free_bytes >= self.needed_after_load(weight_bytes)


class PlanCache:
    def __init__(self, directory: Path) -> None:
        """Checks at once that ``directory`` can be created and written (``ConfigError`` if not)."""
        self.directory = Path(directory).expanduser()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.directory).close()
        except OSError as exc:
            raise ConfigError(f"plan_cache: cannot write to {self.directory}: {exc.strerror or exc}") from None

    def lookup(self, config: BootstrapConfig, resolved: ResolvedClasses, backend: Backend) -> CachedPlan | None:
        """The cached plan for this exact setup on ``backend``'s device, if there is one."""
        return self.load(fingerprint(config, resolved, backend.device, backend.name))

    def remember(
        self, config: BootstrapConfig, resolved: ResolvedClasses, backend: Backend, profile: MemoryProfile, plan: CapacityPlan
    ) -> Path:
        return self.store(fingerprint(config, resolved, backend.device, backend.name), profile, plan)

    def load(self, key: str) -> CachedPlan | None:
        path = self.directory / f"{key}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return CachedPlan(MemoryProfile(**data["profile"]), int(data["kv_budget_bytes"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # missing or unreadable: profile again

    def store(self, key: str, profile: MemoryProfile, plan: CapacityPlan) -> Path:
        """Write atomically, so a concurrent or killed start never reads half a file."""
        data = {"profile": dataclasses.asdict(profile), "kv_budget_bytes": plan.kv_budget_bytes}
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        path = self.directory / f"{key}.json"
        os.replace(tmp, path)
        return path
