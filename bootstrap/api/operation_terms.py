"""What the live operations are called, what a swap may change, how an operation ends (its errors
and the record the history shows), and the other ranks' part: the terms ``bootstrap.api.operations``
and the server share."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from bootstrap.config import BootstrapConfig

MODEL_FIELDS = (  # what describes a model and its memory: all a swap may change
    "model",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "max_seq_len",
    "max_batch_size",
    "max_num_tokens",
    "tokens_per_block",
    "free_gpu_memory_fraction",
    "kv_headroom_bytes",
    "max_kv_bytes",
    "max_kv_tokens",
    "host_cache_bytes",
    "cross_kv_cache_fraction",
    "draft_model",
    "num_speculative_tokens",
    "prefix_caching",
    "overlap",
    "cuda_graphs",
    "cuda_graph_batch_sizes",
    "kv_manager",
)
# the process's (its device, backend and ranks) and the server's own paths (the plan cache): every other field
SAME_IN_A_SWAP = tuple(field for field in BootstrapConfig.model_fields if field not in MODEL_FIELDS)
OPERATION_NAMES = {"swap": "swap", "update_weights": "weights", "sleep": "sleep", "wake": "wake"}  # method -> record
NOUNS = {"weights": "weights update"}  # a record's name in a sentence, where the name alone is not a noun
VERBS = {"weights": "update weights"}  # and as what is asked for


class Busy(RuntimeError):
    """Another operation or the build runs, or the state does not allow this one (HTTP 409)."""


class Refused(ValueError):
    """The operation's check refused what it was given; nothing changed (HTTP 400)."""


class Reverted(ValueError):
    """A swap's new model could not be read after the drain (a ``ConfigError``: a NaN weight, a
    file that changed); the old one was loaded again and serves (HTTP 400)."""


@dataclass
class OperationRecord:
    """One operation as the history shows it (``GET /v1/bootstrap``, the status page)."""

    name: str  # swap | weights | sleep | wake
    detail: str
    started_at: float  # Unix time
    duration_s: float | None = None
    outcome: str = "running"  # running | ok | refused | failed | cancelled
    error: str | None = None
    drain_s: float | None = None  # the caller's drain (requests in flight finishing)
    release_s: float | None = None  # the old state's release (executor, pools, graphs, weights)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OtherRanks(Protocol):
    """The ranks that run each operation alongside this one, told when it begins, when its drain
    ended and when it is over (``serve --tp N``: rank 0's lockstep, ``bootstrap.parallel.lockstep``)."""

    def begin(self, method: str, args: tuple[Any, ...]) -> None: ...

    def drained(self) -> None: ...

    def done(self) -> None: ...

    def stop(self) -> None:
        """The server stops: the other ranks release what they hold and exit."""


def running(busy: str) -> str:
    """What runs, as a noun: ``the weights update is still running``, not ``the weights is``."""
    return NOUNS.get(busy, busy)
