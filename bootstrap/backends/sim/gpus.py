"""Simulated GPUs: memory presets for the dry-run planner and stage tests.

``total_bytes`` is what ``torch.cuda.mem_get_info()[1]`` (or ``get_device_properties(i)
.total_memory``) reports: a few hundred MiB *less* than ``nvidia-smi``'s ``memory.total``, which
the driver keeps out of reach. Each preset's ``source`` says where its figure comes from: the
h200's was measured on this project's H200 machine, the others are torch's ``total_memory`` as
public bug reports print it (``total_memory=81089MB``: ``total_memory // 2**20`` with the unit
"MB", so MiB) or, for the a100-80gb, its OOM messages ("total capacity of 79.15 GiB").

``non_torch_bytes`` is memory a process holds outside torch's caching allocator once it has run
a matrix product (CUDA context, kernel images, cuBLAS/cuBLASLt handles and workspaces), measured
on the H200 and used for every preset: it depends mostly on the CUDA version and the loaded
libraries, little on the card's memory size. The measurements and each preset's sources:
benchmarks/README.md, "Calibration constants in the code".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from bootstrap.config import ConfigError
from bootstrap.devices import FakeDevice

MiB = 1024**2
#: The largest simulated GPU: far above any real one (the largest hold under 300 GB), low enough
#: that a typo does not plan for an exabyte.
MAX_SIM_BYTES = 16 * 1024**4
#: Non-torch memory after CUDA init + first cuBLAS matmuls, measured on an H200 (see above).
CUDA_CONTEXT_BYTES = 623_706_112


@dataclass(frozen=True)
class SimGpu:
    name: str
    total_bytes: int
    non_torch_bytes: int = CUDA_CONTEXT_BYTES
    source: str = ""

    def device(self) -> FakeDevice:
        """A fresh ``FakeDevice`` with this GPU's capacity and context overhead already taken."""
        return FakeDevice(total=self.total_bytes, name=self.name, non_torch=self.non_torch_bytes)


SIM_GPUS: dict[str, SimGpu] = {
    g.name: g
    for g in (
        SimGpu("h200", 150_109_880_320, source="measured here: torch.cuda.mem_get_info on NVIDIA H200"),
        SimGpu("h100-80gb", 81_089 * MiB, source="torch total_memory of NVIDIA H100 80GB HBM3"),
        SimGpu("a100-80gb", 81_050 * MiB, source="torch OOM message 'total capacity of 79.15 GiB'"),
        SimGpu("a100-40gb", 40_536 * MiB, source="torch total_memory of A100-SXM4-40GB"),
        SimGpu("l40s", 45_589 * MiB, source="torch total_memory of NVIDIA L40S"),
        SimGpu("rtx-4090", 24_563 * MiB, source="torch total_memory of NVIDIA GeForce RTX 4090"),
    )
}

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"80GiB"`` → 85899345920; ``"80GB"`` is decimal (8e10); a bare number is bytes.

    Exact (no float rounding: ``"123456789012345678901"`` stays that), floored to whole bytes,
    and in ``[1, MAX_SIM_BYTES]``.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot read {text!r} as a byte count: use an integer number of bytes or a number "
            f"with one of the units {', '.join(u for u in _UNITS if u)} (e.g. '80GiB')"
        )
    number = match.group(1).lstrip("0") or "0"
    nbytes = int(Fraction(number) * _UNITS[unit]) if len(number) <= 40 else MAX_SIM_BYTES + 1
    if not 0 < nbytes <= MAX_SIM_BYTES:
        raise ConfigError(
            f"a simulated GPU size must be in [1 byte, 16 TiB] ([1, {MAX_SIM_BYTES}] bytes), got {text!r}"
        )
    return nbytes


def resolve_sim_gpu(gpu: str) -> SimGpu:
    """A preset by name (case-insensitive), or a custom size: ``custom:80GiB``, ``80GiB``, ``85899345920``."""
    key = gpu.strip().lower()
    if key in SIM_GPUS:
        return SIM_GPUS[key]
    size = gpu.strip()[len("custom:") :] if key.startswith("custom:") else gpu.strip()
    if not size[:1].isdigit():
        presets = ", ".join(SIM_GPUS)
        raise ConfigError(
            f"unknown simulated GPU {gpu!r}: use a preset ({presets}) or a size such as "
            "'custom:80GiB', '80GiB' or a byte count"
        )
    try:
        total = parse_bytes(size)
    except ValueError as exc:
        raise ConfigError(f"simulated GPU {gpu!r}: {exc}") from None
    if total <= CUDA_CONTEXT_BYTES:
        raise ConfigError(
            f"simulated GPU {gpu!r} has {total} bytes, not more than the {CUDA_CONTEXT_BYTES} bytes a "
            "CUDA context takes"
        )
    return SimGpu(f"custom-{total}", total, source="custom size")


def sim_device(gpu: str) -> FakeDevice:
    """A fresh ``FakeDevice`` for a preset name or a custom size (see ``resolve_sim_gpu``)."""
    return resolve_sim_gpu(gpu).device()
