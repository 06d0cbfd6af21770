"""The control plane between the server and the engine's process (``bootstrap.api.control``): an
exception raised in the engine is rebuilt in the server as the class the server acts on, saying
what it said there, its causes chained, so the client's text (``client_text``: what a library
outside the package said is left out) is the one an in-process engine gives; and every message
survives its frame."""

from __future__ import annotations

import pytest

from bootstrap.api import control as c
from bootstrap.api.engine_process import failure_of
from bootstrap.api.operation_terms import Busy, OperationRecord, Refused, Reverted
from bootstrap.config import ConfigError
from bootstrap.engine.executor.stats import EngineStats
from bootstrap.pipeline import StageFailed, failure_paragraph
from bootstrap.pipeline.events import StageEvent, StageStatus
from bootstrap.serve.live.operate import client_text
from bootstrap.serve.startup.remote import rebuilt


def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        try:
            if cause is not None:
                raise cause
        except BaseException as inner:
            raise exc from inner
        raise exc
    except BaseException as caught:
        return caught


def crossed(exc: BaseException) -> BaseException:
    return rebuilt(c.decode_from_engine(c.encode(c.Fatal(failure_of(exc)))).failure)


def test_a_stage_failure_reads_the_same_on_both_sides():
    cause = raised(OSError(28, "No space left on device: weights.bin says 0xdeadbeef"))
    exc = StageFailed("load_model", 3, cause, "free some disk, then POST /v1/bootstrap/retry")
    back = crossed(exc)
    assert isinstance(back, StageFailed) and (back.stage, back.attempts, back.advice) == ("load_model", 3, exc.advice)
    assert str(back) == str(exc) and failure_paragraph(back) == failure_paragraph(exc)
    assert client_text(back, failure_paragraph(back)) == client_text(exc, failure_paragraph(exc))
    assert "0xdeadbeef" not in client_text(back, failure_paragraph(back))  # a library's words stay in the log


@pytest.mark.parametrize("kind", [Refused, Reverted, Busy, ConfigError])
def test_the_operation_s_refusals_come_back_as_themselves(kind):
    exc = raised(kind("max_seq_len: 99999 is over the model's 8192"), ValueError("inner words"))
    back = crossed(exc)
    assert type(back) is kind and str(back) == str(exc)
    assert client_text(back) == client_text(exc)


def test_any_other_error_keeps_its_type_s_name_and_module():
    back = crossed(raised(RuntimeError("the device went away")))
    assert type(back).__name__ == "RuntimeError" and type(back).__module__ == "bootstrap.engine"
    assert str(back) == "the device went away"


def test_every_message_survives_its_frame():
    status = StageStatus("profiling", "done", 2, 1.5, 0.25, None, {"probe_tokens": 2080, "sizes": [1, 2]})
    snapshot = c.Snapshot("swap", 1, True, [status], {"kv_tokens": 8192}, [OperationRecord("swap", "to B", 1.0, 2.0)])
    stats = EngineStats(10, 2, 160, 1, 0)
    served = c.Served(3, ("ipc:///tmp/x/3-commands", "ipc:///tmp/x/3-rounds"), 32000, stats, b"\x80\x04")
    messages = [
        c.Hello(12, snapshot),
        c.Events([StageEvent("profiling", "retrying", 1, "probe_tokens: 132096 -> 2080", {"a": [1]})], snapshot),
        c.Reply(4, snapshot, c.Failure("Busy", "Busy", "the swap runs", causes=[("m", "T", "t")]), served),
        c.DrainAsk(4),
        c.Spans([{"name": "bootstrap.stage.warmup", "attributes": {"x": 1}}]),
    ]
    for message in messages:
        assert c.decode_from_engine(c.encode(message)) == message
    calls = [c.Call(1, "swap", {"config": {"model": "x"}}), c.Abandon(1), c.Drained(1), c.Unserve(3)]
    for message in calls:
        assert c.decode_to_engine(c.encode(message)) == message
