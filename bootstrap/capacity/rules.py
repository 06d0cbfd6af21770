"""The memory rule: how the device memory left after the measured peak is shared with the KV
cache; described here once, everything else links here. Resolved once per run in
``resolve_classes`` into a ``MemoryRule`` (which rule, its value, why), applied by the probe cap
(beside the temporary executor) and by the plan (``capacity``, which records it on its span). The
probe is added back to the budget, so its size changes no figure of the plan; caps
(``max_kv_bytes``, ``max_kv_tokens``, a backend's ``kv_caps``) bound the result under every rule.

1. ``kv_headroom_bytes`` given: the KV cache gets all but that many bytes
   (``budget = total - peak - graphs + probe_kv - headroom``). Not in TensorRT-LLM.
2. ``free_gpu_memory_fraction`` given: TensorRT-LLM's ``budget = (total - peak - graphs +
   probe_kv) * fraction``. Give one of the two; both is a ``ConfigError``.
3. Neither: the backend's headroom where it bounds what its executor may still need (native on
   CUDA: ``backends/native/headroom.py``), from the config for the probe cap and recomputed from
   the profile in ``capacity``; else TensorRT-LLM's default fraction, 0.9.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

DEFAULT_FRACTION = 0.9  # TensorRT-LLM's default free_gpu_memory_fraction
Source = Literal["kv_headroom_bytes", "free_gpu_memory_fraction", "backend_headroom", "default_fraction"]
SOURCES: dict[str, str] = {
    "kv_headroom_bytes": "kv_headroom_bytes given",
    "free_gpu_memory_fraction": "free_gpu_memory_fraction given",
    "backend_headroom": "neither given: the backend's headroom beyond the measured peak",
    "default_fraction": "neither given, and the backend knows no headroom bound: TensorRT-LLM's default fraction",
}


def kv_share(left: int, fraction: float, headroom_bytes: int | None = None) -> int:
    """The KV cache's share of ``left`` bytes (memory left after the measured peak): TensorRT-LLM's
    ``int(left * free_gpu_memory_fraction)``, or, when ``headroom_bytes`` is given
    (``kv_headroom_bytes``), everything but that many bytes (never below 0)."""
    if headroom_bytes is None:
        return int(left * fraction)
    return max(left - headroom_bytes, 0)


def memory_rule(fraction: float, headroom_bytes: int | None = None) -> str:
    """The rule as error messages name it: the field and its value."""
    return f"free_gpu_memory_fraction {fraction}" if headroom_bytes is None else f"kv_headroom_bytes {headroom_bytes:,}"


def describe_rule(source: str, fraction: float, headroom_bytes: int | None) -> str:
    """The rule for people, with where it came from (the ``capacity`` span's ``bootstrap.memory_rule``)."""
    if source == "backend_headroom":
        return f"the backend's headroom of {headroom_bytes:,} bytes (no rule given)"
    if source == "default_fraction":
        return f"free_gpu_memory_fraction {fraction} (TensorRT-LLM's default; no rule given)"
    return memory_rule(fraction, headroom_bytes)


@dataclass(frozen=True)
class MemoryRule:
    """One run's rule: a ``fraction`` (``headroom_bytes`` None) or a headroom in bytes, and why."""

    source: Source
    fraction: float = DEFAULT_FRACTION
    headroom_bytes: int | None = None

    @classmethod
    def resolve(cls, fraction: float | None, headroom_bytes: int | None, backend_headroom: int | None) -> MemoryRule:
        """From the config's two fields and the backend's headroom (None: it knows no bound)."""
        if headroom_bytes is not None:
            return cls("kv_headroom_bytes", headroom_bytes=headroom_bytes)
        if fraction is not None:
            return cls("free_gpu_memory_fraction", fraction=fraction)
        if backend_headroom is not None:
            return cls("backend_headroom", headroom_bytes=backend_headroom)
        return cls("default_fraction")

    def with_backend_headroom(self, headroom_bytes: int | None) -> MemoryRule:
        """The same rule with the backend's headroom recomputed (from the profile); other rules
        are unchanged."""
        if self.source != "backend_headroom" or headroom_bytes is None:
            return self
        return replace(self, headroom_bytes=headroom_bytes)

    def share(self, left: int) -> int:
        return kv_share(left, self.fraction, self.headroom_bytes)

    @property
    def label(self) -> str:
        return describe_rule(self.source, self.fraction, self.headroom_bytes)

    @property
    def why(self) -> str:
        return SOURCES[self.source]
