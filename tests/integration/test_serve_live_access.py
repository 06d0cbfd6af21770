"""What a client of the live operations may ask for and learn (issue 54), on the real engine on
the CPU (the app in process: ``helpers.live_serve``): a swap takes only the fields that describe
a model and its memory, never a path the server writes; an error quotes no file and stays
short; a conflict says which operation runs; ``/v1/models`` keeps listing the model while it
sleeps; a path the server cannot use reads the same whatever it is (nothing to probe)."""

from __future__ import annotations

import json
import os
import shutil

import anyio
import pytest
from helpers.live_serve import Hold, Stream, error_of, serving, settled

from bootstrap.api import Bootstrap, Busy
from bootstrap.api.operation_terms import MODEL_FIELDS, SAME_IN_A_SWAP
from bootstrap.config import BootstrapConfig
from bootstrap.serve.live.named import NOT_A_MODEL, NOT_WEIGHTS
from bootstrap.serve.live.operate import MAX_MESSAGE
from bootstrap.serve.live.routes import SWAP_FIELDS


def test_every_config_field_is_either_a_models_or_the_servers_own():
    fields = set(BootstrapConfig.model_fields)
    assert set(MODEL_FIELDS) | set(SAME_IN_A_SWAP) == fields and not set(MODEL_FIELDS) & set(SAME_IN_A_SWAP)
    assert "plan_cache" in SAME_IN_A_SWAP and set(MODEL_FIELDS) | {"served_model_name"} == SWAP_FIELDS


async def test_a_swap_refuses_the_servers_own_paths_before_writing_anything(llama, tmp_path):
    wanted = tmp_path / "x"
    async with serving(llama) as server:
        for field, value in [("plan_cache", str(wanted)), ("device", "cpu"), ("tensor_parallel_size", 1)]:
            error = error_of(await server.op("/v1/bootstrap/swap", {"model": str(llama), field: value}), 400)
            assert error["param"] == field and error["message"].startswith(f"{field}: the server's own"), error
        assert not wanted.exists()
        assert (await server.http.get("/ready")).json()["state"] == "ready"
        assert (await server.http.get("/v1/bootstrap")).json()["operations"] == []  # refused before any operation


async def test_the_python_swap_keeps_the_servers_plan_cache(llama, tmp_path):
    config = BootstrapConfig(model=str(llama), device="cpu", max_num_tokens=64, max_batch_size=4)
    boot = Bootstrap(config)
    try:
        with pytest.raises(Exception, match="plan_cache: a live server keeps its"):
            await boot.swap(config.model_copy(update={"plan_cache": tmp_path / "x"}))
    finally:
        await boot.aclose()
    assert not (tmp_path / "x").exists()


async def test_the_model_stays_listed_while_it_sleeps_with_its_state(llama):
    async with serving(llama) as server:
        name = server.state.model_id
        assert (await server.op("/v1/bootstrap/sleep", {"level": 1})).status_code == 200
        asleep = await server.http.get("/v1/models")
        assert (await server.op("/v1/bootstrap/wake")).status_code == 200
        awake = await server.http.get("/v1/models")
    assert asleep.status_code == 200, asleep.text
    assert [(m["id"], m["state"]) for m in asleep.json()["data"]] == [(name, "asleep")]
    assert [(m["id"], m["state"]) for m in awake.json()["data"]] == [(name, "ready")]


async def test_a_conflict_names_the_running_weights_update_in_a_sentence(llama):
    async with serving(llama, drain_timeout_s=120) as server:
        hold = Hold(server.state.boot.executor)
        stream = Stream(server.app, server.completion())
        answers = {}

        async def update() -> None:
            answers["weights"] = await server.op("/v1/bootstrap/weights", {"path": str(llama)})

        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(stream.run)
                await stream.next_chunk()  # in flight: the update's drain waits for it
                tg.start_soon(update)
                await settled(server.state, "updating_weights")
                conflict = error_of(await server.op("/v1/bootstrap/weights", {"path": str(llama)}), 409)
                listed = await server.http.get("/v1/models")
                with pytest.raises(Busy) as busy:
                    await server.state.boot.update_weights(str(llama))
            finally:
                hold.release()
            await stream.rest()
    assert "the weights update is running" in conflict["message"], conflict
    assert str(busy.value) == "cannot update weights: the weights update is still running"
    assert listed.status_code == 200 and listed.json()["data"][0]["state"] == "updating_weights"
    assert answers["weights"].status_code == 200


async def test_a_refusal_quotes_no_file_and_stays_short(llama, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"model_type": "SECRET" * 2000}))
    async with serving(llama) as server:
        error = error_of(await server.op("/v1/bootstrap/swap", {"model": f"random:{secret}"}), 400)
        long = error_of(await server.op("/v1/bootstrap/weights", {"path": str(tmp_path) + "/a" * 1500}), 400)
        assert (await server.http.get("/ready")).json()["state"] == "ready"
    assert long["param"] == "path" and long["message"] == NOT_WEIGHTS.format(field="path")
    assert error["param"] == "model" and "resolve_classes" in error["message"], error
    assert "SECRET" not in error["message"] and len(error["message"]) <= MAX_MESSAGE, error


def _not_models(tmp_path, llama) -> list[str]:
    """Paths a client might probe with, none a checkpoint the server can load: each exists in
    another way, or not at all."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "config_only").mkdir()
    shutil.copy(llama / "config.json", tmp_path / "config_only" / "config.json")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "list.json").write_text("[1, 2]")
    os.mkfifo(tmp_path / "fifo")
    missing = tmp_path / "missing"
    return [
        str(missing),
        str(missing / "model.gguf"),
        str(tmp_path / "empty"),
        str(tmp_path / "config_only"),
        str(tmp_path / "notes.txt"),
        str(tmp_path / "notes.txt" / "below"),
        str(tmp_path / "fifo"),
        f"random:{missing}",
        f"random:{tmp_path / 'notes.txt'}",
        f"random:{tmp_path / 'list.json'}",
        f"random:{tmp_path / 'fifo'}",
        "/etc",
    ]


async def test_a_path_the_server_cannot_use_reads_the_same_whatever_it_is(llama, tmp_path):
    paths = _not_models(tmp_path, llama)
    async with serving(llama) as server:
        swaps = [error_of(await server.op("/v1/bootstrap/swap", {"model": p}), 400) for p in paths]
        updates = [error_of(await server.op("/v1/bootstrap/weights", {"path": p}), 400) for p in paths]
        sglang = [error_of(await server.op("/update_weights_from_disk", {"model_path": p}), 400) for p in paths]
        state = (await server.http.get("/ready")).json()["state"]
        text = await server.text()
    assert {(e["message"], e["param"], e["code"]) for e in swaps} == {(NOT_A_MODEL, "model", "operation_refused")}
    assert {(e["message"], e["param"]) for e in updates} == {(NOT_WEIGHTS.format(field="path"), "path")}
    assert {(e["message"], e["param"]) for e in sglang} == {(NOT_WEIGHTS.format(field="model_path"), "model_path")}
    assert state == "ready" and text


async def test_weights_linked_to_another_file_quote_none_of_its_bytes(llama, tmp_path):
    linked = tmp_path / "linked"
    shutil.copytree(llama, linked)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"password=hunter2\n")
    (linked / "model.safetensors").unlink()
    os.symlink(secret, linked / "model.safetensors")
    async with serving(llama) as server:
        error = error_of(await server.op("/v1/bootstrap/weights", {"path": str(linked)}), 400)
        assert (await server.http.get("/ready")).json()["state"] == "ready"
    length = str(int.from_bytes(b"password", "little"))  # what the file's first 8 bytes read as a length
    assert "not a safetensors file (a file of 17 bytes)" in error["message"], error
    assert length not in error["message"] and "hunter2" not in error["message"]
