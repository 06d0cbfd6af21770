"""Request bodies parsed and validated off the event loop (issue 20, round 3).

FastAPI parsed and validated a JSON body on the event loop, so an 8 MiB body (under
``MAX_BODY_BYTES``) of four million token ids, or of half a million messages, held every other
request, ``/health`` included, for seconds (benchmarks/README.md, "Figures without a saved
result"). Here a route reads the bytes and a worker thread does the rest, in the same 400s as
before. A worker thread alone is not enough: ``json.loads``
and pydantic hold the interpreter while they build millions of values, so the body's shape is
counted first (``check_shape``: commas and brackets outside its texts, a C search per text, the
loop free in between) and a body of more values than any request needs is refused unparsed.
Lists are bounded in ``schemas`` too, and an error shows a bounded excerpt (``errors``).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from bootstrap.serve.errors import bad_request, describe_validation
from bootstrap.serve.openai.schemas import MAX_ITEMS, ChatCompletionRequest, CompletionRequest

M = TypeVar("M", bound=BaseModel)
MAX_VALUES = MAX_ITEMS + 2**10  # commas outside texts: token ids for a 128k context, and the other fields
MAX_KEYS = 2**15  # colons outside texts: the fields of every object
MAX_CONTAINERS = 2**13  # objects and arrays: messages and their content parts


DOCUMENTED: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest)


def body_of(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of a route that reads its own body: ``model`` as its JSON body."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def document_bodies(app: FastAPI) -> None:
    """Put the request models of the routes that read their own body (``body_of``) back into
    ``/openapi.json`` and ``/docs``: FastAPI lists only the models it parses itself."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            components = build().setdefault("components", {}).setdefault("schemas", {})
            for model in DOCUMENTED:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def parsed(request: Request, model: type[M]) -> M:
    """The request's body as ``model``, parsed and checked on a worker thread; else a 400."""
    raw = await request.body()
    return await anyio.to_thread.run_sync(validated, raw, model)


def validated(raw: bytes, model: type[M]) -> M:
    """``raw`` (JSON as UTF-8, -16 or -32) as ``model``; an ``APIError`` (400) naming what is wrong."""
    check_shape(raw)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request("body: not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise bad_request(f"body: not valid JSON ({_reason(exc)})") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise describe_validation(exc) from None


def _reason(exc: ValueError) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8, -16 or -32 text: {exc.reason} at byte {exc.start}"
    return str(exc)[:200]


def check_shape(raw: bytes) -> None:
    """400 for a body of more than ``MAX_VALUES`` commas, ``MAX_KEYS`` colons or ``MAX_CONTAINERS``
    brackets outside its strings, counted without parsing it; counting stops at the first bound passed."""
    commas = colons = opens = pos = 0
    while pos < len(raw):
        quote = raw.find(b'"', pos)
        stop = len(raw) if quote < 0 else quote
        commas += raw.count(b",", pos, stop)
        colons += raw.count(b":", pos, stop)
        opens += raw.count(b"[", pos, stop) + raw.count(b"{", pos, stop)
        if commas > MAX_VALUES or colons > MAX_KEYS or opens > MAX_CONTAINERS:
            what = (
                f"{MAX_VALUES} values"
                if commas > MAX_VALUES
                else f"{MAX_KEYS} object fields"
                if colons > MAX_KEYS
                else f"{MAX_CONTAINERS} objects and arrays"
            )
            raise bad_request(
                f"body: more than {what} outside its texts; no request needs that many",
                param="body",
                code="too_many_values",
            )
        pos = len(raw) if quote < 0 else _string_end(raw, quote + 1)


def _string_end(raw: bytes, start: int) -> int:
    """The index after the quote that closes the string whose text begins at ``start``."""
    pos = start
    while (quote := raw.find(b'"', pos)) >= 0:
        before = quote
        while before > start and raw[before - 1] == 0x5C:  # backslashes: an odd count escapes the quote
            before -= 1
        if (quote - before) % 2 == 0:
            return quote + 1
        pos = quote + 1
    return len(raw)
