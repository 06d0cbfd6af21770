"""The live operations over HTTP, as a client calls them, on the real engine on the CPU (the app
in process: ``helpers.live_serve``): a swap, a weights update, sleep and wake answer as a fresh
server on the same model or weights does; a refusal is a 400 naming the field and changes
nothing; a state that does not allow an operation is a 409; every route needs the key.
Requests in flight during an operation: ``test_serve_live_drain.py``; a real process:
``test_serve_live_process.py``."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from helpers.live_serve import error_of, fresh_answers, perturbed, serving

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
            ({"model": str(tmp_path / "missing")}, "model", "resolve_classes"),
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
        assert outcomes == ["refused"], outcomes  # the missing source's check; the others are refused before any


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
