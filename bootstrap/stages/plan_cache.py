"""Plan cache: a measured memory profile, stored under a fingerprint of everything it depends on.

A later start with the same fingerprint skips ``estimation_build`` and ``profiling`` when the
device has room for the plan now: free memory covers the activation peak plus the KV budget.
It never demands equality with a fluctuating figure such as free memory at the last start.
An entry that cannot be used (unreadable, damaged, written for another fingerprint) is ignored
with one warning, and the start profiles again; so is a store that fails.

The model enters the fingerprint as its normalized shape without the checkpoint's stored dtype
(``model_key``): that dtype only picks the default dtype, which the fingerprint holds as the
resolved one. So one model is one key however its config is read: a ``.gguf`` file's metadata
(no dtype) on the first start, the ``config.json`` of its converted checkpoint (float32) on every
later one; models of different shapes never share a key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from bootstrap.backends.artifacts import ResolvedClasses
from bootstrap.capacity import CapacityPlan, MemoryProfile
from bootstrap.capacity.shape import ModelShape
from bootstrap.config import BootstrapConfig, ConfigError, ensure_directory
from bootstrap.devices import Device

if TYPE_CHECKING:
    from bootstrap.backends.base import Backend

log = logging.getLogger(__name__)

# Config fields left out of the fingerprint; every other field is in it, so a field added later
# invalidates cached plans rather than reusing one measured without it. The model and the draft
# enter through their normalized shapes (a preset and its config.json are one model), the device
# through its name and total memory; where plans are cached changes nothing.
NOT_FINGERPRINTED = frozenset({"model", "draft_model", "device", "plan_cache"})
LIBRARIES = ("executor-bootstrap", "torch", "transformers", "tensorrt-llm")


@functools.cache  # reading a distribution's metadata parses files (about 8 ms each); one process, one answer
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def model_key(shape: ModelShape) -> str:
    """The shape's fingerprint, its ``torch_dtype`` (how the checkpoint stores the weights) left
    out: the weights load in the resolved dtype, which the fingerprint holds, so the stored one
    changes no measured figure; it only differs with where the config was read (see above)."""
    return dataclasses.replace(shape, torch_dtype=None).fingerprint()


def fingerprint(config: BootstrapConfig, resolved: ResolvedClasses, device: Device, backend: str) -> str:
    parts = {
        "model": model_key(resolved.shape),
        "draft": model_key(resolved.draft_shape) if resolved.draft_shape else None,
        "resolved_dtype": [resolved.dtype, resolved.kv_dtype, resolved.max_seq_len],
        "device": [device.name, device.total_bytes()],
        "backend": backend,
        "libraries": {d: _version(d) for d in LIBRARIES},
        "config": {f: getattr(config, f) for f in sorted(type(config).model_fields) if f not in NOT_FINGERPRINTED},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class CachedPlan:
    profile: MemoryProfile
    kv_budget_bytes: int

    def needed_after_load(self, weight_bytes: int) -> int:
        """Bytes a start needs once ``weight_bytes`` of weights are loaded: the rest of the
        measured torch peak (executor state, activations) less the probe, plus the CUDA graphs'
        reserve and the KV budget.

        Memory outside torch (CUDA context, other processes) is left out: free memory read after
        the load has already paid for it. At ``free_gpu_memory_fraction`` 1.0 on the same device
        this equals the free memory of the original start, so an identical start still fits.
        """
        p = self.profile
        return max(p.torch_peak_bytes - p.probe_kv_bytes - weight_bytes, 0) + p.graph_bytes + self.kv_budget_bytes

    def fits(self, free_bytes: int, weight_bytes: int) -> bool:
        return free_bytes >= self.needed_after_load(weight_bytes)


class PlanCache:
    def __init__(self, directory: Path) -> None:
        """Checks at once that ``directory`` can be created and written (``ConfigError`` if not)."""
        self.directory = ensure_directory(Path(directory).expanduser(), "plan_cache")
        try:
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
        """The plan stored under ``key``; None if there is none, or (with one warning) if the
        entry cannot be used: unreadable, truncated, not this format, or written for another key."""
        path = self.directory / f"{key}.json"
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            return _ignored(path, exc.strerror or str(exc))
        try:
            return _parse(blob, key)
        except (ValueError, KeyError, TypeError, OverflowError) as exc:  # JSON and Unicode errors are ValueErrors
            return _ignored(path, str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}")

    def store(self, key: str, profile: MemoryProfile, plan: CapacityPlan) -> Path:
        """Write atomically, so a concurrent or killed start never reads half a file; a failed
        write leaves no temporary file behind (and raises ``OSError``)."""
        data = {"fingerprint": key, "profile": dataclasses.asdict(profile), "kv_budget_bytes": plan.kv_budget_bytes}
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
            path = self.directory / f"{key}.json"
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


def _parse(blob: bytes, key: str) -> CachedPlan:
    data = json.loads(blob)
    if not isinstance(data, dict) or data.get("fingerprint") != key:
        raise ValueError("written for another setup, or by another version")
    budget = data["kv_budget_bytes"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"kv_budget_bytes must be an integer >= 0, got {budget!r}")
    return CachedPlan(MemoryProfile(**data["profile"]), budget)


def _ignored(path: Path, reason: str) -> None:
    log.warning("plan cache: ignoring %s (%s); profiling again", path, reason)
    return None
