"""``POST /v1/bootstrap/swap | weights | sleep | wake``, and the routes vLLM and SGLang give the
same operations, as aliases for the tools that call them: ``POST /sleep?level=N``, ``POST
/wake_up``, ``GET /is_sleeping``, ``POST /update_weights_from_disk``. All behind ``--api-key``; on an
address other than loopback, refused without one unless ``--allow-open-operations`` (``auth``)."""

from __future__ import annotations

import json

import anyio
from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from bootstrap.api.operation_terms import MODEL_FIELDS, SAME_IN_A_SWAP
from bootstrap.config import BootstrapConfig, ConfigError, is_int
from bootstrap.serve.auth import operations_allowed
from bootstrap.serve.errors import APIError, describe_validation
from bootstrap.serve.live.named import check_model, check_weights_path
from bootstrap.serve.live.operate import OperationAnswer, run_operation
from bootstrap.serve.state import ServeState

router = APIRouter(dependencies=[Depends(operations_allowed)])  # bound elsewhere than loopback: the key, or opened
SWAP_FIELDS = frozenset(MODEL_FIELDS) | {"served_model_name"}  # a model and its memory; never a path the server writes


def _state(request: Request) -> ServeState:
    return request.app.state.serve


async def _body(request: Request) -> dict[str, object]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_body")
    return body


def _text(body: dict[str, object], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise APIError(400, f"{field}: required, a non-empty string", param=field, code="invalid_value")
    return value


def swap_config(state: ServeState, body: dict[str, object]) -> tuple[BootstrapConfig, str]:
    """The config a swap body asks for: the server's own flags with the body's fields over
    them (``model`` required), and the model id clients will send. A field of the server's own
    (``SAME_IN_A_SWAP``: its device and ranks, its plan cache) is refused, even at its value."""
    own = sorted(set(body) & set(SAME_IN_A_SWAP))
    if own:
        raise APIError(
            400,
            f"{own[0]}: the server's own setting, never a client's; a swap takes: {', '.join(sorted(SWAP_FIELDS))}",
            param=own[0],
            code="invalid_value",
        )
    unknown = sorted(set(body) - SWAP_FIELDS)
    if unknown:
        raise APIError(
            400,
            f"{unknown[0]}: not a field a swap takes; allowed: {', '.join(sorted(SWAP_FIELDS))}",
            param=unknown[0],
            code="invalid_value",
        )
    model = _text(body, "model")
    fields = {k: v for k, v in body.items() if k != "served_model_name"}
    try:
        config = BootstrapConfig.model_validate({**state.config.model_dump(), **fields})
    except ValidationError as exc:  # one line per bad field, the field as param when there is one
        error = describe_validation(exc)
        raise APIError(400, error.message, param=error.param, code="invalid_value") from None
    except ConfigError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None
    name = body.get("served_model_name", model)
    if not isinstance(name, str) or not name.strip():
        raise APIError(400, "served_model_name: a non-empty string", param="served_model_name", code="invalid_value")
    return config, name


@router.post("/v1/bootstrap/swap")
async def swap(request: Request) -> OperationAnswer:
    """Serve another model (``{"model": SOURCE, ...}``, any of ``SWAP_FIELDS`` beside it)."""
    state = _state(request)
    config, name = swap_config(state, await _body(request))
    await anyio.to_thread.run_sync(check_model, config.model, config.backend)

    async def call(drain):
        async def drain_then_rename() -> None:
            await drain()
            state.model_id = name  # the old model goes now: a failure resumed by a retry serves the new one

        return await state.boot.swap(config, drain=drain_then_rename)

    return await run_operation(state, request.app.state.tasks, "swap", call, "model")


@router.post("/v1/bootstrap/weights")
async def weights(request: Request) -> OperationAnswer:
    """New weights of the same model in place (``{"path": DIR}``)."""
    state = _state(request)
    path = _text(await _body(request), "path")
    return await _weights(request, state, path)


async def _weights(request: Request, state: ServeState, path: str, field: str = "path") -> OperationAnswer:
    await anyio.to_thread.run_sync(check_weights_path, path, field)
    call = lambda drain: state.boot.update_weights(path, drain=drain)  # noqa: E731
    return await run_operation(state, request.app.state.tasks, "weights", call, "path")


@router.post("/v1/bootstrap/sleep")
async def sleep(request: Request) -> OperationAnswer:
    """Give the device back (``{"level": 1 | 2}``, default 1)."""
    body = await _body(request)
    return await _sleep(request, _level(body.get("level", 1)))


def _level(value: object) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not is_int(value) or value not in (1, 2):
        raise APIError(
            400, f"level: {value!r} is not a sleep level; allowed: 1 or 2", param="level", code="invalid_value"
        )
    return value


async def _sleep(request: Request, level: int) -> OperationAnswer:
    state = _state(request)
    call = lambda drain: state.boot.sleep(level, drain=drain)  # noqa: E731
    return await run_operation(state, request.app.state.tasks, "sleep", call, "level")


@router.post("/v1/bootstrap/wake")
async def wake(request: Request) -> OperationAnswer:
    """The model back after a sleep."""
    state = _state(request)
    call = lambda drain: state.boot.wake()  # noqa: E731
    return await run_operation(state, request.app.state.tasks, "wake", call, "level")


# ---- vLLM's and SGLang's routes for the same operations ----------------------------------------


@router.post("/sleep")
async def vllm_sleep(request: Request, level: str = "1") -> OperationAnswer:
    """vLLM's ``POST /sleep?level=N``."""
    return await _sleep(request, _level(level))


@router.post("/wake_up")
async def vllm_wake_up(request: Request) -> OperationAnswer:
    """vLLM's ``POST /wake_up``."""
    return await wake(request)


@router.get("/is_sleeping")
async def vllm_is_sleeping(request: Request) -> dict[str, bool]:
    """vLLM's ``GET /is_sleeping``: true from the end of a sleep to the end of the wake (as vLLM's
    flag), and after a wake that failed before the weights came back (still asleep)."""
    state = _state(request)
    asleep = state.boot is not None and bool(state.boot.asleep)
    return {"is_sleeping": state.phase in ("asleep", "waking") or (state.phase == "failed" and asleep)}


@router.post("/update_weights_from_disk")
async def sglang_update_weights(request: Request) -> dict[str, bool | str]:
    """SGLang's ``POST /update_weights_from_disk`` (``{"model_path": DIR}``): its answer's shape."""
    state = _state(request)
    path = _text(await _body(request), "model_path")
    done = await _weights(request, state, path, "model_path")
    return {"success": True, "message": f"weights updated from {path} in {done['duration_s']} s"}
