"""The control plane between the server's process and the engine's process (``serve``'s default):
what crosses besides the requests (``messages``). Both sides import this module, and no other
across the channel.

To the engine: ``Start`` (once, first), ``Call`` (a method of its ``Bootstrap``: a build, a
retry, a live operation, the close), ``Abandon`` (a call's caller gave up: cancel it), ``Drained``
(the answer to ``DrainAsk``) and ``Unserve``. From it: ``Hello`` or ``Fatal`` (the backend made,
or not), ``Events`` (stage events), ``Reply`` (a call's end), ``DrainAsk`` (an operation's drain:
the server holds the requests, so it drains them) and ``Spans`` (finished spans as trace-file
records: one trace file, written by the server). Each message but ``Spans`` carries a ``Snapshot``,
so the server answers its pages from what it holds and never waits on the engine for them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from bootstrap.api.operation_terms import OperationRecord
from bootstrap.engine.executor.stats import EngineStats
from bootstrap.pipeline.events import StageEvent, StageStatus


class Failure(msgspec.Struct, frozen=True):
    """An exception raised in the engine's process, as the server rebuilds it: ``kind`` names the
    class the server acts on (``StageFailed``, ``Refused``, ``Reverted``, ``Busy``,
    ``ConfigError``, ``Cancelled``; ``other``), ``causes`` its chain (module, type, text), nearest first."""

    kind: str
    type_name: str
    text: str
    stage: str | None = None  # StageFailed's
    attempts: int = 0
    advice: str = ""
    causes: list[tuple[str, str, str]] = []


class Served(msgspec.Struct, frozen=True):
    """A started executor's channel (``core``: which one, for ``Unserve``): the server's
    ``EngineClient`` binds ``addresses``, which the engine's ``EngineCore`` has connected to.
    ``tokenizer``: the executor's, pickled (None: ids only)."""

    core: int
    addresses: tuple[str, str]
    vocab_size: int
    stats: EngineStats
    tokenizer: bytes | None = None


class Snapshot(msgspec.Struct, frozen=True):
    """What the server reads of the engine's ``Bootstrap`` between messages; ``report`` (its
    ``BootstrapReport`` as a dict) is only sent with a ``Reply`` or ``Hello``."""

    busy: str | None
    asleep: int
    live: bool  # an executor is started
    status: list[StageStatus]
    plan: dict[str, Any]
    operations: list[OperationRecord]
    report: dict[str, Any] | None = None


class Start(msgspec.Struct, frozen=True, tag=True):
    """``config``: the ``BootstrapConfig`` as JSON data; ``parent``: the server's process span
    (trace id, span id), which the pipeline's spans join; ``sys_path``: the server's, so a
    ``--backend-factory`` module it could import is found here too."""

    config: dict[str, Any]
    backend_factory: str | None
    otlp: bool
    forward_spans: bool
    parent: tuple[str, str] | None  # hex, as W3C trace context writes them (a trace id is 128 bits)
    bind_dir: str  # where the engine binds each executor's sockets (the server's private directory)
    sys_path: list[str] = []


class Call(msgspec.Struct, frozen=True, tag=True):
    """``method`` of the engine's ``Bootstrap`` (``build``, ``retry``, ``swap``, ``update_weights``,
    ``sleep``, ``wake``, ``aclose``) with ``args``, its keywords; one ``Reply`` answers it."""

    call_id: int
    method: str
    args: dict[str, Any] = {}


class Abandon(msgspec.Struct, frozen=True, tag=True):
    call_id: int


class Drained(msgspec.Struct, frozen=True, tag=True):
    call_id: int


class Unserve(msgspec.Struct, frozen=True, tag=True):
    """The server closed its end of ``core``: the engine closes its own."""

    core: int


class Hello(msgspec.Struct, frozen=True, tag=True):
    pid: int
    snapshot: Snapshot


class Fatal(msgspec.Struct, frozen=True, tag=True):
    failure: Failure


class Events(msgspec.Struct, frozen=True, tag=True):
    events: list[StageEvent]
    snapshot: Snapshot


class Reply(msgspec.Struct, frozen=True, tag=True):
    """A call's end: its failure, or none; ``served``: the executor that serves after it, if any."""

    call_id: int
    snapshot: Snapshot
    failure: Failure | None = None
    served: Served | None = None
    ended_ns: int = 0  # when the call's own work ended there (Unix ns), before its channel was made


class DrainAsk(msgspec.Struct, frozen=True, tag=True):
    call_id: int


class Spans(msgspec.Struct, frozen=True, tag=True):
    records: list[dict[str, Any]]


ToEngine = Start | Call | Abandon | Drained | Unserve
FromEngine = Hello | Fatal | Events | Reply | DrainAsk | Spans
encode = msgspec.msgpack.Encoder().encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_from_engine = msgspec.msgpack.Decoder(FromEngine).decode
