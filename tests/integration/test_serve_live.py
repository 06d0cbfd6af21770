"""The live operations over HTTP, as a client calls them, on the real engine on the CPU (the app
in process: ``helpers.live_serve``): a swap, a weights update, sleep and wake answer as a fresh
server on the same model or weights does; a refusal is a 400 naming the field and changes
nothing; a state that does not allow an operation is a 409; every route needs the key.
Requests in flight during an operation: ``test_serve_live_drain.py``; a real process:
``test_serve_live_process.py``."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
from helpers.live_serve import BOUND_S, Hold, Stream, error_of, fresh_answers, perturbed, serving, settled

KEY = "live-key-0123"


@pytest.fixture(scope="module")
def tuned(llama, tmp_path_factory) -> Path:
    """The llama checkpoint with other weights (an "RL step")."""
    return perturbed(llama, tmp_path_factory.mktemp("ckpt") / "tuned")


@pytest.fixture(scope="module")
def fresh(llama, qwen, tuned) -> dict[str, str]:
    found = anyio.run(fresh_answers, {"llama": llama, "qwen": qwen, "tuned": tuned})
    assert len(set(found.values())) == 3, found
    return found


# ---- swap ---------------------------------------------------------------------------------------


async def test_a_swap_serves_the_new_model_as_a_fresh_server_does_under_its_new_name(llama, qwen, fresh):
    async with serving(llama) as server:
        assert await server.text() == fresh["llama"]
        swapped = await server.op("/v1/bootstrap/swap", {"model": str(qwen), "served_model_name": "qwen-small"})
        assert swapped.status_code == 200, swapped.text
        body = swapped.json()
        assert (body["operation"], body["state"], body["model"]) == ("swap", "ready", "qwen-small")
        assert isinstance(body["duration_s"], float) and body["duration_s"] > 0
        rows = {row["id"]: row["outcome"] for row in body["stages"]}
        assert rows["resolve_classes"] == rows["load_model"] == rows["scheduler_sampler"] == "ok", rows
        models = (await server.http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["qwen-small"]
        assert error_of(await server.complete(str(llama)), 404)["code"] == "model_not_found"
        assert await server.text("qwen-small") == fresh["qwen"]
        back = await server.op("/v1/bootstrap/swap", {"model": str(llama)})  # no name: the source, as --model
        assert back.status_code == 200 and back.json()["model"] == str(llama)
        assert await server.text(str(llama)) == fresh["llama"]
        view = (await server.http.get("/v1/bootstrap")).json()
        assert [(o["name"], o["outcome"]) for o in view["operations"]] == [("swap", "ok"), ("swap", "ok")]
        assert view["operations"][0]["detail"] == f"model={qwen}" and view["operations"][0]["duration_s"] > 0
        page = (await server.http.get("/metrics")).text
        assert 'bootstrap_operations_total{name="swap",outcome="ok"} 2.0' in page
        assert 'bootstrap_phase{phase="ready"} 1.0' in page and 'bootstrap_phase{phase="swapping"} 0.0' in page


async def test_a_refused_swap_names_the_field_and_the_old_model_keeps_serving(llama, tmp_path, fresh):
    async with serving(llama) as server:
        cases = [
            ({"model": str(tmp_path / "missing")}, "model", "model: not a checkpoint directory"),
            ({"model": str(llama), "colour": "blue"}, "colour", "colour: not a field a swap takes"),
            ({"model": str(llama), "device": "cuda"}, "device", "device: the server's own setting, never a client's"),
            ({"served_model_name": "x"}, "model", "model: required"),
            ({"model": str(llama), "max_batch_size": 0}, "max_batch_size", "max_batch_size"),
        ]
        for body, param, words in cases:
            error = error_of(await server.op("/v1/bootstrap/swap", body), 400)
            assert error["param"] == param and words in error["message"], (body, error)
            ready = await server.http.get("/ready")
            assert ready.status_code == 200 and ready.json()["state"] == "ready"
            assert await server.text() == fresh["llama"]
        for raw in ("{not json", "[1, 2]"):
            response = await server.http.post(
                "/v1/bootstrap/swap", content=raw, headers={"Content-Type": "application/json"}
            )
            assert error_of(response, 400)["code"] in ("invalid_json", "invalid_body")
        outcomes = [o["outcome"] for o in (await server.http.get("/v1/bootstrap")).json()["operations"]]
        assert outcomes == [], outcomes  # every one refused before an operation began (a path before its stages)


# ---- weights ------------------------------------------------------------------------------------


async def test_new_weights_answer_as_a_fresh_start_on_them_and_a_wrong_shape_changes_nothing(
    llama, tuned, tmp_path, fresh
):
    tensor = "model.layers.1.self_attn.o_proj.weight"
    bad = perturbed(llama, tmp_path / "bad", reshape=tensor)
    async with serving(llama) as server:
        updated = await server.op("/v1/bootstrap/weights", {"path": str(tuned)})
        assert updated.status_code == 200, updated.text
        assert (updated.json()["operation"], updated.json()["state"]) == ("weights", "ready")
        assert await server.text() == fresh["tuned"]
        error = error_of(await server.op("/v1/bootstrap/weights", {"path": str(bad)}), 400)
        assert error["param"] == "path" and error["code"] == "operation_refused" and tensor in error["message"]
        assert (await server.http.get("/ready")).json()["state"] == "ready"
        assert await server.text() == fresh["tuned"]
        assert error_of(await server.op("/v1/bootstrap/weights", {}), 400)["param"] == "path"
        sglang = await server.op("/update_weights_from_disk", {"model_path": str(llama)})
        assert sglang.status_code == 200 and sglang.json()["success"] is True, sglang.text
        assert str(llama) in sglang.json()["message"]
        assert await server.text() == fresh["llama"]
        outcomes = [(o["name"], o["outcome"]) for o in (await server.http.get("/v1/bootstrap")).json()["operations"]]
        assert outcomes == [("weights", "ok"), ("weights", "refused"), ("weights", "ok")]


# ---- sleep and wake -----------------------------------------------------------------------------


async def test_sleep_at_both_levels_and_wake_give_the_same_answers(llama, fresh):
    async with serving(llama) as server:
        asleep = [("/v1/bootstrap/sleep", {"level": 1}, "/v1/bootstrap/wake"), ("/sleep?level=2", None, "/wake_up")]
        for sleep, body, wake in asleep:
            slept = await server.op(sleep, body)
            assert slept.status_code == 200 and slept.json()["state"] == "asleep", slept.text
            ready = await server.http.get("/ready")
            assert ready.status_code == 503 and ready.json()["state"] == "asleep"
            refused = await server.complete()
            assert error_of(refused, 503)["code"] == "asleep" and "Retry-After" in refused.headers
            assert (await server.http.get("/is_sleeping")).json() == {"is_sleeping": True}
            again = error_of(await server.op("/v1/bootstrap/sleep", {"level": 1}), 409)
            assert again["code"] == "operation_conflict"
            assert error_of(await server.op("/v1/bootstrap/weights", {"path": str(llama)}), 409)["code"] == (
                "operation_conflict"
            )
            woken = await server.op(wake)
            assert woken.status_code == 200 and woken.json()["state"] == "ready", woken.text
            assert (await server.http.get("/is_sleeping")).json() == {"is_sleeping": False}
            assert await server.text() == fresh["llama"]
        for level in ({"level": 3}, {"level": "two"}, {"level": True}):
            error = error_of(await server.op("/v1/bootstrap/sleep", level), 400)
            assert error["param"] == "level" and "not a sleep level" in error["message"]
        assert error_of(await server.op("/sleep?level=3"), 400)["param"] == "level"
        awake = error_of(await server.op("/v1/bootstrap/wake"), 409)
        assert awake["code"] == "operation_conflict" and "ready" in awake["message"]
        assert error_of(await server.op("/wake_up"), 409)["code"] == "operation_conflict"
        view = (await server.http.get("/v1/bootstrap")).json()
        assert [(o["name"], o["detail"], o["outcome"]) for o in view["operations"]] == [
            ("sleep", "level=1", "ok"),
            ("wake", "level=1", "ok"),
            ("sleep", "level=2", "ok"),
            ("wake", "level=2", "ok"),
        ]


async def test_is_sleeping_says_whether_the_weights_are_away_while_idle_mid_operation_and_failed(
    llama, fresh, monkeypatch
):
    """As vLLM's: true from the end of a sleep to the end of the wake that brings the model back.
    So false while idle (no model, nothing asleep) and while a sleep drains (the model still
    answers what is in flight); true while a wake runs, and after a wake that failed before the
    weights came back (the model is still asleep: a retry wakes it)."""
    from bootstrap.backends.native.backend import NativeBackend

    async def is_sleeping(server) -> bool:
        return (await server.http.get("/is_sleeping")).json()["is_sleeping"]

    async with serving(llama, idle=True) as server:
        assert server.state.phase == "idle" and await is_sleeping(server) is False

    restoring, restore, load, failures = threading.Event(), NativeBackend.restore_weights, NativeBackend.load_model, [1]

    def held_restore(self, host):
        restoring.wait(BOUND_S)
        return restore(self, host)

    def failing_load(self, *args, **kwargs):
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("the weights could not be read")
        return load(self, *args, **kwargs)

    async with serving(llama, drain_timeout_s=BOUND_S) as server:
        hold, stream, done = Hold(server.state.boot.executor), Stream(server.app, server.completion()), {}

        async def call(route: str, body: dict | None = None) -> None:
            done[route] = await server.op(route, body)

        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(stream.run)
                await stream.next_chunk()
                tg.start_soon(call, "/v1/bootstrap/sleep", {"level": 1})
                await settled(server.state, "sleeping")  # draining the stream
                assert await is_sleeping(server) is False
            finally:
                hold.release()
        assert done["/v1/bootstrap/sleep"].status_code == 200 and await is_sleeping(server) is True

        monkeypatch.setattr(NativeBackend, "restore_weights", held_restore)
        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(call, "/v1/bootstrap/wake")
                await settled(server.state, "waking")
                assert await is_sleeping(server) is True  # the weights are not back yet
            finally:
                restoring.set()
        assert done["/v1/bootstrap/wake"].status_code == 200 and await is_sleeping(server) is False

        assert (await server.op("/v1/bootstrap/sleep", {"level": 2})).status_code == 200
        monkeypatch.setattr(NativeBackend, "load_model", failing_load)
        assert error_of(await server.op("/v1/bootstrap/wake"), 500)["code"] == "operation_failed"
        assert server.state.phase == "failed" and await is_sleeping(server) is True
        assert (await server.op("/v1/bootstrap/retry")).status_code == 202
        await settled(server.state, "ready")
        assert await is_sleeping(server) is False and await server.text() == fresh["llama"]


# ---- the API key --------------------------------------------------------------------------------


async def test_every_operation_route_needs_the_key(llama):
    routes = [
        ("POST", "/v1/bootstrap/swap", {"model": str(llama)}),
        ("POST", "/v1/bootstrap/weights", {"path": str(llama)}),
        ("POST", "/v1/bootstrap/sleep", {"level": 1}),
        ("POST", "/v1/bootstrap/wake", None),
        ("POST", "/v1/bootstrap/retry", None),
        ("POST", "/sleep?level=1", None),
        ("POST", "/wake_up", None),
        ("GET", "/is_sleeping", None),
        ("POST", "/update_weights_from_disk", {"model_path": str(llama)}),
    ]
    async with serving(llama, api_key=KEY) as server:
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                response = await server.http.request(method, path, json=body, headers=headers)
                assert error_of(response, 401)["code"] == "invalid_api_key", (path, headers)
        assert server.state.phase == "ready" and server.state.boot.operations == []  # nothing ran
        right = {"Authorization": f"Bearer {KEY}"}
        assert (await server.http.get("/is_sleeping", headers=right)).json() == {"is_sleeping": False}
        slept = await server.http.post("/sleep?level=1", headers=right)
        assert slept.status_code == 200 and slept.json()["state"] == "asleep"
