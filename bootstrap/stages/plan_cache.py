"""Plan cache: a measured memory profile, stored under a fingerprint of everything it depends on
(``fingerprint``): its one full account (``docs/design.md`` points here).

A later start with the same fingerprint skips ``estimation_build`` and ``profiling`` when the
device has room for the plan now (free memory covers the activation peak plus the KV budget) and
not much more room than when it was measured (``CachedPlan.much_more_room``: a plan measured
while another job held memory is a measurement, not a limit). An entry that
cannot be used (unreadable, damaged, another fingerprint's) costs one warning and a profiling
run; so does a store that fails. An entry is read only when it is a regular file of at most
``MAX_ENTRY_BYTES`` (``read_entry``): never through a link, never from a FIFO or a device, so it
never blocks nor reads without end (it runs where the skip check runs: a worker thread). A
directory that cannot be written costs one warning: its plans are used, none is stored.
``bootstrap cache clear`` deletes only what ``is_own_file`` recognises, by name and by the first
bytes ``store`` writes, and the directory only when ``PlanCache`` created it (``MARKER``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from bootstrap.backends.artifacts import ResolvedClasses
from bootstrap.capacity import CapacityPlan, MemoryProfile
from bootstrap.capacity.shape import ModelShape
from bootstrap.config import BootstrapConfig, ConfigError, is_int
from bootstrap.devices import Device
from bootstrap.paths import file_in_the_way, open_regular

if TYPE_CHECKING:
    from bootstrap.backends.base import Backend

log = logging.getLogger(__name__)

# Config fields left out of the fingerprint; every other field is in it, so a field added later
# invalidates cached plans rather than reusing one measured without it. The model and the draft
# enter through their normalized shapes (a preset and its config.json are one model), the device
# through its name and total memory; where plans are cached and whether prefixes are reused
# (cached blocks are free capacity) change nothing.
NOT_FINGERPRINTED = frozenset({"model", "draft_model", "device", "plan_cache", "prefix_caching", "overlap"})
LIBRARIES = ("executor-bootstrap", "torch", "transformers", "tensorrt-llm")

MORE_ROOM = 1.25  # free beside the weights above this times the measured: profile again
MAX_ENTRY_BYTES = 1 << 20  # an entry is about 400 bytes; anything near this size is not one
ENTRY_NAME = re.compile(r"(?P<key>[0-9a-f]{32})\.json")
# ``store``'s temporary file (``<key>.<mkstemp's 8 characters>.tmp``; older versions: ``tmp<8>.tmp``)
STAGING_NAME = re.compile(r"(?:(?P<key>[0-9a-f]{32})\.|tmp)[a-z0-9_]{8}\.tmp")
HEADER = re.compile(rb'\{\s*"fingerprint":\s*"(?P<key>[0-9a-f]{32})"')  # how every file ``store`` writes begins
MARKER = ".executor-bootstrap-plans"  # in a directory PlanCache created: clear may remove it once empty
MARKER_TEXT = b"created by executor-bootstrap's plan cache; bootstrap cache clear removes it once empty\n"


@functools.cache  # reading a distribution's metadata parses files (milliseconds each); one process, one answer
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def model_key(shape: ModelShape) -> str:
    """The shape's fingerprint, its ``torch_dtype`` (how the checkpoint stores the weights) left
    out: the weights load in the resolved dtype, which the fingerprint holds, so the stored one
    changes no measured figure. So one model is one key however its config is read: a ``.gguf``
    file's metadata (no dtype) on the first start, its converted checkpoint's ``config.json``
    (float32) on every later one; models of different shapes never share a key."""
    return dataclasses.replace(shape, torch_dtype=None).fingerprint()


def fingerprint(config: BootstrapConfig, resolved: ResolvedClasses, device: Device, backend: str) -> str:
    """What a profile depends on, hashed: the model's and the draft's shapes (``model_key``), the
    resolved dtypes and ``max_seq_len``, the device's name and total memory, the backend, the
    versions of ``LIBRARIES``, and every config field but ``NOT_FINGERPRINTED``."""
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
    free_bytes: int | None = None  # free before the measured start loaded anything; None: an older entry

    def measured_free(self) -> int:
        """Free memory before the measured start loaded anything: recorded, or (older entries)
        from the profile: free before the forward plus the probe, weights and executor state."""
        if self.free_bytes is not None:
            return self.free_bytes
        p = self.profile
        return p.free_before_bytes + p.probe_kv_bytes + p.model_bytes

    def much_more_room(self, free_bytes: int, weight_bytes: int) -> bool:
        """True when ``free_bytes`` (beside the weights now) exceeds ``MORE_ROOM`` times what was
        free beside them when measured: what held memory then (another job) is gone, and the plan
        would keep its limit."""
        return free_bytes > MORE_ROOM * max(self.measured_free() - weight_bytes, 0)

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
        """Creates ``directory`` if need be. A file in the way is an input error (``ConfigError``);
        a directory that cannot be created or written (read-only, no permission) costs one
        warning: its plans are still read, none is stored (``writable``)."""
        self.directory = Path(directory).expanduser()
        self.writable = self._prepare()

    def _prepare(self) -> bool:
        existed = os.path.isdir(self.directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.directory).close()
        except OSError as exc:
            if (blocker := file_in_the_way(self.directory)) is not None:
                raise ConfigError(
                    f"plan_cache: cannot write to {self.directory}: {blocker} is not a directory"
                ) from None
            log.warning(
                "plan cache: cannot write to %s (%s); using the plans there, storing none",
                self.directory,
                exc.strerror or exc,
            )
            return False
        if not existed:
            with contextlib.suppress(OSError):  # only what lets clear remove the directory is lost
                (self.directory / MARKER).write_bytes(MARKER_TEXT)
        return True

    def lookup(self, config: BootstrapConfig, resolved: ResolvedClasses, backend: Backend) -> CachedPlan | None:
        """The cached plan for this exact setup on ``backend``'s device, if there is one."""
        return self.load(fingerprint(config, resolved, backend.device, backend.name))

    def remember(
        self,
        config: BootstrapConfig,
        resolved: ResolvedClasses,
        backend: Backend,
        profile: MemoryProfile,
        plan: CapacityPlan,
        free_bytes: int | None = None,
    ) -> Path | None:
        """Store the plan; None when the directory cannot be written (its one warning came at
        construction: a start must not warn again for each plan it cannot store)."""
        if not self.writable:
            return None
        key = fingerprint(config, resolved, backend.device, backend.name)
        return self.store(key, profile, plan, free_bytes, setup(config, resolved, backend))

    def remember_measured(
        self,
        config: BootstrapConfig,
        resolved: ResolvedClasses,
        backend: Backend,
        profile: MemoryProfile,
        plan: CapacityPlan,
    ) -> None:
        """Run after ``capacity`` (``api.make_pipeline``): store its plan with the free memory it
        was measured with, unless a retry lowered ``max_num_tokens`` (one transient OOM must not
        halve every later start). A failure to write costs the next start a profiling run, not
        this start: one warning."""
        if profile.max_num_tokens != config.max_num_tokens:
            return
        free = CachedPlan(profile, plan.kv_budget_bytes).measured_free()
        try:
            self.remember(config, resolved, backend, profile, plan, free)
        except OSError as exc:
            log.warning("plan cache: could not store the plan in %s: %s", self.directory, exc)

    def load(self, key: str) -> CachedPlan | None:
        """The plan stored under ``key``; None if there is none, or (with one warning) if the
        entry cannot be used: not a regular file, too large, unreadable, truncated, not UTF-8,
        nested too deeply, not this format, or written for another key."""
        path = self.directory / f"{key}.json"
        try:
            return _parse(read_entry(path), key)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return _ignored(path, exc.strerror or str(exc))
        except RecursionError:
            return _ignored(path, "JSON nested too deeply")
        except (ValueError, KeyError, TypeError, OverflowError) as exc:  # JSON and Unicode errors are ValueErrors
            return _ignored(path, str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}")

    def store(
        self,
        key: str,
        profile: MemoryProfile,
        plan: CapacityPlan,
        free_bytes: int | None = None,
        about: dict[str, object] | None = None,
    ) -> Path:
        """Write atomically, so a concurrent or killed start never reads half a file; a failed
        write leaves no temporary file behind (and raises ``OSError``). ``about``: the setup in
        words (``setup``), for ``bootstrap cache list``; a lookup never reads it."""
        data: dict[str, object] = {"fingerprint": key, "setup": about} if about else {"fingerprint": key}
        data |= {"profile": dataclasses.asdict(profile), "kv_budget_bytes": plan.kv_budget_bytes}
        if free_bytes is not None:
            data["free_bytes"] = free_bytes
        text = json.dumps(data, indent=1)  # "fingerprint" first: the HEADER that marks the file as ours
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f"{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            path = self.directory / f"{key}.json"
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


def setup(config: BootstrapConfig, resolved: ResolvedClasses, backend: Backend) -> dict[str, object]:
    """What a stored plan is for, as ``bootstrap cache list`` shows it (the key holds more)."""
    return {
        "model": config.model,
        "max_seq_len": resolved.max_seq_len,
        "dtype": resolved.dtype,
        "quantization": config.quantization,
        "kv_dtype": resolved.kv_dtype,
        "max_batch_size": config.max_batch_size,
        "max_num_tokens": config.max_num_tokens,
        "tp": config.tensor_parallel_size,
        "device": backend.device.name,
        "device_total_bytes": backend.device.total_bytes(),
        "backend": backend.name,
    }


def stored_setup(path: Path) -> dict[str, object] | None:
    """The ``setup`` a plan file records; None for an older entry or one that cannot be read."""
    try:
        data = json.loads(read_entry(path).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    about = data.get("setup") if isinstance(data, dict) else None
    return about if isinstance(about, dict) else None


def read_entry(path: Path) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``MAX_ENTRY_BYTES``; a link,
    FIFO, device, directory or larger file raises ``OSError`` saying which, before any read
    (``paths.open_regular``: nothing blocks or is followed)."""
    with open_regular(path) as fd:
        if (size := os.fstat(fd).st_size) > MAX_ENTRY_BYTES:
            raise OSError(f"{size} bytes, more than the {MAX_ENTRY_BYTES} a plan may hold")
        chunks, size = [], 0
        while chunk := os.read(fd, MAX_ENTRY_BYTES + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_ENTRY_BYTES:
                raise OSError(f"larger than {MAX_ENTRY_BYTES} bytes, too large for a plan")
    return b"".join(chunks)


def is_own_file(path: Path) -> bool:
    """True for a file ``store`` wrote: an entry or the temporary file of a killed store, by its
    name and by how it begins (the fingerprint its name holds); never a link or another file."""
    name = ENTRY_NAME.fullmatch(path.name) or STAGING_NAME.fullmatch(path.name)
    if name is None:
        return False
    try:
        header = HEADER.match(read_entry(path))
    except OSError:
        return False
    return header is not None and name["key"] in (None, header["key"].decode())


def is_own_directory(directory: Path) -> bool:
    """True when ``PlanCache`` created ``directory`` (its ``MARKER`` holds ``MARKER_TEXT``)."""
    try:
        return read_entry(directory / MARKER) == MARKER_TEXT
    except OSError:
        return False


def _parse(blob: bytes, key: str) -> CachedPlan:
    try:
        text = blob.decode("utf-8")  # what store writes; json.loads would also take UTF-16 or UTF-32
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("fingerprint") != key:
        raise ValueError("written for another setup, or by another version")
    budget = data["kv_budget_bytes"]
    if not is_int(budget) or budget < 0:
        raise ValueError(f"kv_budget_bytes must be an integer >= 0, got {budget!r}")
    free = data.get("free_bytes")
    if free is not None and (not is_int(free) or free < 0):
        raise ValueError(f"free_bytes must be an integer >= 0, got {free!r}")
    return CachedPlan(MemoryProfile(**data["profile"]), budget, free)


def _ignored(path: Path, reason: str) -> None:
    log.warning("plan cache: ignoring %s (%s); profiling again", path, reason)
    return None
