"""Who may run the live operations, and what a POST must declare (issue 54, defect 2), against a
real app (httpx over ASGI, no lifespan, so no torch): on an address other than loopback the
operations need ``--api-key`` or ``--allow-open-operations`` (said at start), every POST with a
body is JSON by its ``Content-Type`` (what no cross-site form sends), and other sites are refused
on every address."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest

from bootstrap.cli.serve import serve_options
from bootstrap.config import BootstrapConfig
from bootstrap.serve.app import create_app
from bootstrap.serve.state import ServeOptions, ServeState

KEY = "s3cret"
OPERATIONS = [
    "/v1/bootstrap/swap",
    "/v1/bootstrap/weights",
    "/v1/bootstrap/sleep",
    "/v1/bootstrap/wake",
    "/v1/bootstrap/retry",
    "/sleep?level=1",
    "/wake_up",
    "/update_weights_from_disk",
]
JSON = {"Content-Type": "application/json"}


def client(host: str | None = "0.0.0.0", **options: object) -> httpx.AsyncClient:
    state = ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m", host=host, **options))
    app = create_app(state)
    app.state.tasks = None  # no lifespan: the operations are refused by their checks before they would start
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://10.0.0.5:8000")


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and "\n" not in body["message"]
    return body


@pytest.mark.parametrize("path", OPERATIONS)
async def test_an_open_address_without_a_key_refuses_the_operations_saying_why(path):
    async with client() as http:
        refused = await http.post(path, json={"model": "m", "path": "/x", "model_path": "/x", "level": 1})
        asleep = await http.get("/is_sleeping")  # reads only
    found = error(refused, 403)
    assert found["code"] == "operations_closed" and "--api-key" in found["message"]
    assert "--allow-open-operations" in found["message"] and "0.0.0.0" in found["message"]
    assert asleep.status_code == 200


@pytest.mark.parametrize("path", OPERATIONS)
@pytest.mark.parametrize(
    ("host", "options", "headers"),
    [
        ("0.0.0.0", {"api_key": KEY}, {"Authorization": f"Bearer {KEY}"}),
        ("0.0.0.0", {"allow_open_operations": True}, {}),
        (None, {}, {}),  # not bound (in process): as before
    ],
    ids=["key", "allowed", "unbound"],
)
async def test_a_key_or_the_explicit_flag_opens_the_operations(path, host, options, headers):
    async with client(host, **options) as http:
        response = await http.post(path, headers=headers)
    assert response.status_code in (400, 409), response.text  # reached the operation: nothing to operate on yet


def test_an_open_address_is_said_at_start(caplog):
    with caplog.at_level(logging.WARNING, logger="bootstrap.serve"):
        for host, opened in [("0.0.0.0", False), ("::", True), ("127.0.0.1", False)]:
            options = ServeOptions(model_id="m", host=host, allow_open_operations=opened)
            create_app(ServeState(BootstrapConfig(model="m"), options))
    closed, opened = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "0.0.0.0" in closed and "live operations are refused" in closed
    assert "'::'" in opened and "--allow-open-operations" in opened and "anyone" in opened


def test_the_flag_reaches_the_options():
    values = dict(port=8000, shutdown_timeout=30.0, api_key=None, served_model_name=None, trace_file=None)
    args = argparse.Namespace(**values, otlp=False, backend_factory=None, allow_open_operations=True)
    assert serve_options(args, BootstrapConfig(model="m")).allow_open_operations is True


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1", None])
@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", b'{"model": "m", "prompt": "hi"}'), ("/v1/bootstrap/swap", b'{"model": "m"}')],
)
@pytest.mark.parametrize("declared", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
async def test_a_post_with_a_body_must_declare_json(host, path, body, declared):
    headers = {} if declared is None else {"Content-Type": declared}
    async with client(host, allow_open_operations=True) as http:
        refused = await http.post(path, content=body, headers={"Host": "localhost", **headers})
    found = error(refused, 415)
    assert found["code"] == "unsupported_media_type" and found["type"] == "invalid_request_error"
    assert "application/json" in found["message"] and found["param"] == "Content-Type"


@pytest.mark.parametrize("declared", ["application/json", "Application/JSON; charset=utf-8"])
async def test_json_is_taken_with_its_parameters_and_a_bodiless_post_without_a_type(declared):
    async with client("127.0.0.1") as http:
        completion = await http.post(
            "/v1/completions", content=b'{"model": "m"}', headers={"Host": "localhost", "Content-Type": declared}
        )
        bodiless = await http.post("/v1/bootstrap/retry", headers={"Host": "localhost"})  # the status page's button
        sleep = await http.post("/sleep?level=1", headers={"Host": "localhost"})  # vLLM's clients send no body
        empty_form = await http.post("/sleep?level=1", headers={"Host": "localhost", "Content-Type": "text/plain"})
    assert error(completion, 400)["param"] == "prompt"  # parsed: the body's own error
    assert error(bodiless, 409)["code"] == "nothing_to_retry" and error(sleep, 409)["code"] == "operation_conflict"
    assert error(empty_form, 415)["code"] == "unsupported_media_type"  # what an empty form sends


async def test_an_open_address_refuses_other_sites_but_takes_any_host():
    site = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    async with client("0.0.0.0", allow_open_operations=True) as http:
        forged = await http.post("/sleep?level=1", headers=site)
        same_site = await http.post("/v1/bootstrap/retry", headers={"Sec-Fetch-Site": "same-site"})
        named = await http.post("/v1/bootstrap/retry", headers={"Host": "gpu-box.internal:8000"})
        own_page = await http.post(
            "/v1/bootstrap/retry", headers={"Host": "gpu-box.internal:8000", "Origin": "http://gpu-box.internal:8000"}
        )
    assert error(forged, 403)["code"] == error(same_site, 403)["code"] == "cross_site"
    assert error(named, 409)["code"] == error(own_page, 409)["code"] == "nothing_to_retry"
