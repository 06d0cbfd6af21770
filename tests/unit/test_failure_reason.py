"""A failure is logged with what happened, never ``None``: a cause with no message is named by its
type, and the server logs the failure it caught, not a phase a shutdown in progress kept."""

from __future__ import annotations

import logging

from bootstrap.config import BootstrapConfig
from bootstrap.pipeline import StageFailed, failure_paragraph
from bootstrap.serve.startup import task
from bootstrap.serve.state import ServeOptions, ServeState


def test_a_cause_without_a_message_is_named_by_its_type():
    for cause in (RuntimeError(None), RuntimeError(), ConnectionResetError("")):
        text = failure_paragraph(StageFailed("load_model", 1, cause))
        assert text == f"bootstrap failed at stage 'load_model' after 1 attempt: {type(cause).__name__} (no message)"
    assert failure_paragraph(StageFailed("profiling", 2, MemoryError("out"))).endswith("2 attempts: out")


async def test_a_failure_during_a_shutdown_is_logged_with_its_reason(caplog):
    state = ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m"), phase="shutting_down")

    async def build():
        raise StageFailed("load_model", 1, RuntimeError("the peer rank closed the store"))

    with caplog.at_level(logging.ERROR, logger="bootstrap.serve"):
        await task._settle(state, build)
    (record,) = caplog.records
    message = record.getMessage()
    assert "None" not in message and "bootstrap failed: bootstrap failed" not in message
    assert message.startswith("bootstrap failed at stage 'load_model' after 1 attempt: the peer rank closed the store")
    assert state.phase == "shutting_down"
