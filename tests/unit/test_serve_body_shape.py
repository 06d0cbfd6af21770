"""Bodies counted before they are parsed (``bodies.check_shape``): one value, object field or
container over each bound is a 400 ``too_many_values`` naming the bound; at the bound it is
parsed (and answered by the usual checks). In process, before any bootstrap."""

from __future__ import annotations

import httpx
import pytest

from bootstrap.config import BootstrapConfig
from bootstrap.serve.app import create_app
from bootstrap.serve.openai.bodies import MAX_CONTAINERS, MAX_KEYS, MAX_VALUES
from bootstrap.serve.state import ServeOptions, ServeState


def values(extra: int) -> bytes:
    """``MAX_VALUES + extra`` commas outside texts: one after the model, one between each two ids."""
    return b'{"model": "m", "prompt": [' + b",".join([b"1"] * (MAX_VALUES + extra)) + b"]}"


def keys(extra: int) -> bytes:
    """``MAX_KEYS + extra`` colons outside texts: three fields, and the nested object's."""
    fields = b", ".join(b'"k%d": 0' % i for i in range(MAX_KEYS - 3 + extra))
    return b'{"model": "m", "prompt": "a: b: c", "x": {' + fields + b"}}"  # the prompt's colons are text


def containers(extra: int) -> bytes:
    """``MAX_CONTAINERS + extra`` brackets outside texts: the body, the list, and its items."""
    items = b",".join([b"[]", b"{}"] * ((MAX_CONTAINERS - 2 + extra) // 2) + [b"[]"] * ((MAX_CONTAINERS + extra) % 2))
    return b'{"model": "m", "prompt": "[{[{", "x": [' + items + b"]}"


@pytest.mark.parametrize(
    ("body", "bound"),
    [(values, f"{MAX_VALUES} values"), (keys, f"{MAX_KEYS} object fields"), (containers, f"{MAX_CONTAINERS} objects")],
)
@pytest.mark.parametrize("form", ["application/json", "application/json; charset=utf-8"])  # others: a 415
async def test_a_body_just_over_each_shape_bound_is_too_many_values(body, bound, form):
    state = ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://s") as http:
        over = await http.post("/v1/completions", content=body(1), headers={"Content-Type": form})
        at = await http.post("/v1/completions", content=body(0), headers={"Content-Type": form})
    error = over.json()["error"]
    assert over.status_code == 400 and error["code"] == "too_many_values" and error["param"] == "body"
    assert error["message"].startswith(f"body: more than {bound}")
    assert at.json()["error"]["code"] != "too_many_values"  # parsed: the schema or the 503 answers it
