"""Live operations on checkpoints that cannot load, over HTTP on the real engine on the CPU (the
app in process: ``helpers.live_serve``), each while a stream is in flight. What the headers and
config.json show (a tensor missing or renamed, a truncated file, a vocabulary other than the
tensors', a fused projection's part missing, a KV scale out of its range) is a 400 naming it,
answered while the stream is still held mid-answer: no drain, nothing aborted, the old model
answers as before. A NaN weight, found only while the bytes are read, fails a swap after the
drain: the old model comes back (read again), the answer names the tensor and the server is
ready on it. A weights update from a folder with a NaN tensor is refused before the drain."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import httpx
import pytest
import torch
from helpers.broken_checkpoints import WEIGHTS, copy_checkpoint, edit_config, replace_tensors
from helpers.live_serve import BOUND_S, Hold, Server, Stream, error_of, fresh_answers, serving, settled, text_and_finish

LAYER = "model.layers.1"


def renamed(tensors: dict) -> dict:
    tensors[f"{LAYER}.mlp.down_proj.weights"] = tensors.pop(f"{LAYER}.mlp.down_proj.weight")
    return tensors


def kv_scales(tensors: dict) -> dict:
    """Both layers' key and value scales, layer 0's key scale 0 (allowed: 1e-6..1e3)."""
    for layer in (0, 1):
        for kind in "kv":
            value = 0.0 if (layer, kind) == (0, "k") else 1.0
            tensors[f"model.layers.{layer}.self_attn.{kind}_scale"] = torch.tensor(value)
    return tensors


def truncate(path: Path) -> None:
    file = path / WEIGHTS
    file.write_bytes(file.read_bytes()[:-64])


BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {  # kind: (the break, what the refusal names)
    "missing": (
        lambda p: replace_tensors(p, lambda t: {k: v for k, v in t.items() if k != f"{LAYER}.mlp.up_proj.weight"}),
        f"{LAYER}.mlp.up_proj.weight",
    ),
    "renamed": (lambda p: replace_tensors(p, renamed), f"{LAYER}.mlp.down_proj.weights"),
    "truncated": (truncate, "data_offsets"),
    "vocab": (lambda p: edit_config(p, vocab_size=320), "checkpoint shape (256, 64), the model's (320, 64)"),
    "fused_part": (
        lambda p: replace_tensors(p, lambda t: {k: v for k, v in t.items() if "0.self_attn.q_proj" not in k}),
        "model.layers.0.self_attn.q_proj.weight",
    ),
    "kv_scale": (lambda p: replace_tensors(p, kv_scales), "model.layers.0.self_attn.k_scale"),
}


def with_nan(llama: Path, target: Path, name: str) -> Path:
    path = copy_checkpoint(llama, target)
    replace_tensors(path, lambda t: t | {name: torch.full_like(t[name], math.nan)})
    return path


@pytest.fixture(scope="module")
def fresh(llama) -> dict[str, str]:
    return anyio.run(fresh_answers, {"llama": llama})


async def answered_while_serving(server: Server, call: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
    """``call``'s answer, which must come while the server stays ``ready`` (no drain: a held
    stream would keep a drain waiting); fails at the first other phase instead."""
    found: dict[str, httpx.Response] = {}
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            found["answer"] = await call()
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        with anyio.fail_after(BOUND_S):
            while True:
                change = server.state.changes.next()
                assert server.state.phase == "ready", f"the operation moved the server to {server.state.phase}"
                await change.wait()
    return found["answer"]


async def whole_stream(stream: Stream, first: dict) -> tuple[str, str | None]:
    events = await stream.rest()
    assert events[-1] == "[DONE]" and stream.status == 200
    return text_and_finish([first, *map(json.loads, events[:-1])])


@pytest.mark.parametrize("kind", sorted(BROKEN))
async def test_a_swap_to_a_checkpoint_whose_headers_show_it_broken_is_400_before_the_drain(
    kind, llama, tmp_path, fresh
):
    breaks, named = BROKEN[kind]
    broken = copy_checkpoint(llama, tmp_path / kind)
    breaks(broken)
    async with serving(llama, drain_timeout_s=BOUND_S) as server:
        hold, stream = Hold(server.state.boot.executor), Stream(server.app, server.completion())
        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(stream.run)
                first = await stream.next_chunk()  # the next forward waits for the hold
                body = {"model": str(broken), "served_model_name": "broken"}
                refused = await answered_while_serving(server, lambda: server.op("/v1/bootstrap/swap", body))
                assert len(server.state.inflight) == 1  # still held mid-answer when the refusal came
            finally:
                hold.release()
        assert await whole_stream(stream, first) == (fresh["llama"], "length")
        error = error_of(refused, 400)
        assert error["code"] == "operation_refused" and named in error["message"], error
        assert server.state.phase == "ready" and server.state.model_id == str(llama)
        assert await server.text() == fresh["llama"]
        view = (await server.http.get("/v1/bootstrap")).json()
        assert [(o["name"], o["outcome"]) for o in view["operations"]] == [("swap", "refused")]


async def test_a_swap_whose_nan_weight_shows_only_while_reading_brings_the_old_model_back(llama, tmp_path, fresh):
    name = f"{LAYER}.mlp.down_proj.weight"
    broken = with_nan(llama, tmp_path / "nan", name)
    async with serving(llama, drain_timeout_s=BOUND_S) as server:
        hold, stream, swap = Hold(server.state.boot.executor), Stream(server.app, server.completion()), {}

        async def swap_to_broken() -> None:
            swap["answer"] = await server.op("/v1/bootstrap/swap", {"model": str(broken), "served_model_name": "b"})

        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(stream.run)
                first = await stream.next_chunk()
                tg.start_soon(swap_to_broken)
                await settled(server.state, "swapping")  # the headers passed: draining the stream
            finally:
                hold.release()
        assert await whole_stream(stream, first) == (fresh["llama"], "length")  # not aborted
        error = error_of(swap["answer"], 400)
        assert error["code"] == "operation_reverted" and name in error["message"], error
        assert "not finite" in error["message"] and str(llama) in error["message"]
        assert server.state.phase == "ready" and server.state.model_id == str(llama)
        assert [m["id"] for m in (await server.http.get("/v1/models")).json()["data"]] == [str(llama)]
        assert await server.text() == fresh["llama"]
        view = (await server.http.get("/v1/bootstrap")).json()
        assert view["retryable"] is False
        assert [(o["name"], o["outcome"]) for o in view["operations"]] == [("swap", "failed")]


async def test_a_weights_update_with_a_nan_tensor_is_400_naming_it_and_the_old_weights_keep_serving(
    llama, tmp_path, fresh
):
    name = f"{LAYER}.self_attn.o_proj.weight"
    broken = with_nan(llama, tmp_path / "nan", name)
    async with serving(llama, drain_timeout_s=BOUND_S) as server:
        hold, stream = Hold(server.state.boot.executor), Stream(server.app, server.completion())
        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(stream.run)
                first = await stream.next_chunk()
                body = {"path": str(broken)}
                refused = await answered_while_serving(server, lambda: server.op("/v1/bootstrap/weights", body))
            finally:
                hold.release()
        assert await whole_stream(stream, first) == (fresh["llama"], "length")
        error = error_of(refused, 400)
        assert error["code"] == "operation_refused" and error["param"] == "path", error
        assert name in error["message"] and "not finite" in error["message"]
        assert server.state.phase == "ready" and await server.text() == fresh["llama"]
