"""The live TensorRT-LLM objects each stage hands on, in holders that can let go of them.

Artifacts are frozen and may outlive their release (the pipeline keeps them for ``retry``), so
they hold these holders, never TensorRT-LLM objects directly: ``release()`` drops every reference,
which is what frees GPU memory that torch owns (weights, CUDA graphs, a never-started executor).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Engines:
    """``LoadedModel.handle``: what ``create_py_executor`` builds before any KV cache."""

    args: Any = None  # this load's deep copy of the user's TorchLlmArgs
    mapping: Any = None
    dist: Any = None
    features: Any = None  # AttentionRuntimeFeatures
    engine: Any = None  # PyTorchModelEngine
    draft: Any = None  # draft PyTorchModelEngine (two-model speculative decoding)
    sampler: Any = None  # built before any KV cache and shared by both executors, as TRT does
    max_seq_len: int = 0  # TRT's model_engine_max_seq_len: engine limit + overlap / draft tokens
    max_batch_size: int = 0
    max_num_tokens: int = 0

    def release(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


@dataclass
class Build:
    """One set of KV managers (probe or final) and the ``PyExecutor`` on them."""

    resources: dict[Any, Any] = field(default_factory=dict)  # ResourceManagerType -> manager
    creators: list[Any] = field(default_factory=list)  # KvCacheCreator per manager set
    executor: Any = None
    started: bool = False  # start_worker() ran: shutdown() is safe (and needed)
    shut_down: bool = False  # shutdown() ran: it also shut every resource manager down
    max_seq_len: int = 0  # the creator's _max_seq_len after the managers (SWA may shrink it)
    max_num_tokens: int = 0
    probe_tokens: int = 0  # estimation only: the max_tokens its managers were built for

    @property
    def spent(self) -> bool:
        """The executor ran and was shut down: its managers are gone with it."""
        return self.shut_down


class TrtllmExecutor:
    """The started ``PyExecutor`` (``executor`` artifact); ``shutdown`` is safe to call twice."""

    def __init__(self, py_executor: Any, build: Build, stop: Any) -> None:
        self.py_executor = py_executor
        self._build = build
        self._stop = stop

    @property
    def is_running(self) -> bool:
        return self._build.started and not self._build.shut_down

    def shutdown(self) -> None:
        self._stop()
