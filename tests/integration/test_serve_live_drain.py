"""Requests in flight while a live operation runs, over HTTP on the real engine on the CPU (the app
in process: ``helpers.live_serve``). The executor's forwards after a stream's first token wait
for the test (``Hold``), so the drain finds it mid-answer on any machine: with a long drain
timeout it finishes on the old model while new requests get a 503 naming the operation and
other operations a 409; past the timeout it ends with ``abort`` and its partial output. Either
way nothing stays counted in flight. A stage that fails after the release is a 500 that
``POST /v1/bootstrap/retry`` resumes."""

from __future__ import annotations

import json

import anyio
import pytest
from helpers.live_serve import (
    BOUND_S,
    TOKENS,
    Hold,
    Stream,
    error_of,
    fresh_answers,
    in_flight,
    serving,
    settled,
    text_and_finish,
)
from helpers.serve_process import metric


@pytest.fixture(scope="module")
def fresh(llama, qwen) -> dict[str, str]:
    found = anyio.run(fresh_answers, {"llama": llama, "qwen": qwen})
    assert found["llama"] != found["qwen"], found
    return found


async def test_a_stream_in_flight_finishes_on_the_old_model_while_the_swap_waits_and_refuses_others(llama, qwen, fresh):
    async with serving(llama, drain_timeout_s=BOUND_S) as server:
        old = server.state.boot.executor
        hold = Hold(old)
        stream, swap = Stream(server.app, server.completion()), {}

        async def swap_to_qwen() -> None:
            swap["response"] = await server.op("/v1/bootstrap/swap", {"model": str(qwen), "served_model_name": "q"})

        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(stream.run)
                first = await stream.next_chunk()  # its first token: the next forward waits for the hold
                tg.start_soon(swap_to_qwen)
                await settled(server.state, "swapping")  # checked, now draining
                assert (await server.http.get("/health")).status_code == 200
                ready = await server.http.get("/ready")
                assert ready.status_code == 503 and ready.json()["state"] == "swapping"
                refused = await server.complete()
                error = error_of(refused, 503)
                assert error["code"] == "operation_in_progress" and "swap" in error["message"]
                assert int(refused.headers["Retry-After"]) >= 1
                others = [
                    ("/v1/bootstrap/swap", {"model": str(llama)}),
                    ("/v1/bootstrap/weights", {"path": str(llama)}),
                    ("/v1/bootstrap/sleep", {"level": 1}),
                    ("/v1/bootstrap/wake", None),
                    ("/sleep?level=1", None),
                    ("/update_weights_from_disk", {"model_path": str(llama)}),
                ]
                for path, body in others:
                    conflict = error_of(await server.op(path, body), 409)
                    assert conflict["code"] == "operation_conflict" and "swap is running" in conflict["message"]
                assert (await server.http.get("/v1/bootstrap")).json()["operations"][-1]["outcome"] == "running"
                assert len(server.state.inflight) == 1 and "swap" not in swap
            finally:
                hold.release()
        events = await stream.rest()
        assert events[-1] == "[DONE]"
        text, finish = text_and_finish([first, *map(json.loads, events[:-1])])
        assert stream.status == 200 and (text, finish) == (fresh["llama"], "length")  # all of it, on the old model
        assert swap["response"].status_code == 200 and swap["response"].json()["state"] == "ready"
        assert await server.text("q") == fresh["qwen"]
        assert await in_flight(server, old) == (0,) * 7 and not old.is_running


async def test_past_the_drain_timeout_a_stream_ends_with_abort_and_its_partial_output(llama, qwen, fresh):
    async with serving(llama, drain_timeout_s=0) as server:
        old = server.state.boot.executor
        hold = Hold(old, until_cancel=True)  # the forward after the first waits for the cut
        stream = Stream(server.app, server.completion())
        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(stream.run)
                first = await stream.next_chunk()
                swapped = await server.op("/v1/bootstrap/swap", {"model": str(qwen)})
                events = await stream.rest()
            finally:
                hold.release()
        assert swapped.status_code == 200 and swapped.json()["cut_short"] == 1, swapped.text
        assert events[-1] == "[DONE]"
        text, finish = text_and_finish([first, *map(json.loads, events[:-1])])
        assert finish == "abort"
        words = text.split()
        assert 1 <= len(words) < TOKENS and fresh["llama"].split()[: len(words)] == words, (text, fresh["llama"])
        assert await in_flight(server, old) == (0,) * 7 and not old.is_running
        page = (await server.http.get("/metrics")).text
        assert metric(page, "bootstrap_requests_total", endpoint="completion", finish_reason="abort") == 1
        assert await server.text(str(qwen)) == fresh["qwen"]


# ---- a failure after the release, and its retry -------------------------------------------------


async def test_a_swap_that_fails_after_the_release_is_500_and_a_retry_serves_the_new_model(
    llama, qwen, fresh, monkeypatch
):
    from bootstrap.backends.native.backend import NativeBackend

    real, left = NativeBackend.build_final, [1]

    def failing_once(self, *args, **kwargs):
        if left[0]:
            left[0] -= 1
            raise RuntimeError("the pools could not be made")
        return real(self, *args, **kwargs)

    async with serving(llama) as server:
        monkeypatch.setattr(NativeBackend, "build_final", failing_once)
        failed = await server.op("/v1/bootstrap/swap", {"model": str(qwen), "served_model_name": "q"})
        error = error_of(failed, 500)
        assert error["code"] == "operation_failed" and "final_build" in error["message"]
        ready = await server.http.get("/ready")
        assert ready.status_code == 503 and ready.json()["state"] == "failed"
        assert "final_build" in ready.json()["error"] and "the pools could not be made" in ready.json()["error"]
        assert error_of(await server.complete("q"), 503)["code"] == "bootstrap_failed"
        assert (await server.http.get("/v1/bootstrap")).json()["retryable"] is True
        retried = await server.op("/v1/bootstrap/retry")
        assert retried.status_code == 202 and retried.json()["resumed_from"] == "final_build", retried.text
        await settled(server.state, "ready")
        assert [m["id"] for m in (await server.http.get("/v1/models")).json()["data"]] == ["q"]
        assert await server.text("q") == fresh["qwen"]
        view = (await server.http.get("/v1/bootstrap")).json()
        assert [(o["name"], o["outcome"]) for o in view["operations"]] == [("swap", "failed"), ("swap", "ok")]
        assert "final_build" in view["operations"][0]["error"]
