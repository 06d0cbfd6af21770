"""What crosses the channel, as msgspec structs: the only module both sides import.

To the engine: ``Submit`` (one prompt's choices, named by the server's ids) and ``Cancel``. From
it: one ``Round`` per engine round that published anything, carrying every event of every
request the round advanced and the engine's load after it (never one message per token).
Frames are msgpack; the engine re-checks what it decodes (``SamplingParams.__post_init__``).
"""

from __future__ import annotations

import msgspec

from bootstrap.engine.executor.stats import EngineStats
from bootstrap.engine.request.stream_event import StreamEvent
from bootstrap.engine.sampling.params import SamplingParams
from bootstrap.engine.spec.counts import SpeculationStats


class Submit(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Queue ``len(request_ids)`` choices of ``prompt`` (one prefill, ``PyExecutor.enqueue_choices``)."""

    request_ids: list[int]
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class Cancel(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Give these requests up; each still ends with its final event (``cancelled``)."""

    request_ids: list[int]


class Round(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Every event one engine round published, in order, with the load after it (and, with a
    draft model, its acceptance counts)."""

    events: list[tuple[int, StreamEvent]]
    stats: EngineStats
    speculation: SpeculationStats | None = None


ToEngine = Submit | Cancel
encode = msgspec.msgpack.Encoder().encode
decode_command = msgspec.msgpack.Decoder(ToEngine).decode
decode_round = msgspec.msgpack.Decoder(Round).decode
