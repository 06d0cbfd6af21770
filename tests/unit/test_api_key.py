"""The server's API key (issue 20, item 12), against a real app (httpx over ASGI, no lifespan, so
no torch): a configured key loses its surrounding whitespace (a key file's newline), a key that
is empty after that is refused before anything starts (exit 2, naming the setting), and with a
key every route but ``/health``, ``/ready`` and ``/metrics`` needs it, the docs included. The
app says once that a key is required, never the key."""

from __future__ import annotations

import argparse
import logging

import httpx
import pytest

from bootstrap.cli.main import main
from bootstrap.cli.serve import ENV_API_KEY, serve_options
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.serve.app import create_app
from bootstrap.serve.state import ServeOptions, ServeState

KEY = "s3cret"
RIGHT = {"Authorization": f"Bearer {KEY}"}
GUARDED = ["/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/v1/models", "/v1/bootstrap", "/no/such/route"]


def args(**overrides: object) -> argparse.Namespace:
    values = dict(
        port=8000,
        shutdown_timeout=30.0,
        api_key=None,
        served_model_name=None,
        trace_file=None,
        otlp=False,
        backend_factory=None,
    )
    return argparse.Namespace(**{**values, **overrides})


def client(options: ServeOptions) -> httpx.AsyncClient:
    app = create_app(ServeState(BootstrapConfig(model="m"), options))
    # localhost: serve_options binds 127.0.0.1 by default, which refuses any other Host (``serve.auth``)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")


@pytest.mark.parametrize("configured", [f"{KEY}\n", f"{KEY}\r\n", f"  {KEY}\t \n"], ids=repr)
@pytest.mark.parametrize("source", ["env", "flag"])
async def test_a_key_with_surrounding_whitespace_accepts_the_right_key(configured, source, monkeypatch):
    monkeypatch.setenv(ENV_API_KEY, configured) if source == "env" else monkeypatch.delenv(ENV_API_KEY, raising=False)
    options = serve_options(args(api_key=configured if source == "flag" else None), BootstrapConfig(model="m"))
    assert options.api_key == KEY
    async with client(options) as http:
        right = await http.get("/v1/bootstrap", headers=RIGHT)
        wrong = await http.get("/v1/bootstrap", headers={"Authorization": f"Bearer {KEY}x"})
    assert right.status_code == 200 and wrong.status_code == 401


@pytest.mark.parametrize("configured", ["", "\n", " \r\n\t"], ids=repr)
def test_a_key_empty_after_stripping_is_refused_naming_the_setting(configured):
    with pytest.raises(ConfigError, match="api_key: must not be empty"):
        ServeOptions(model_id="m", api_key=configured)  # an empty key must never mean an open server


def test_a_key_with_a_control_character_inside_is_refused():
    with pytest.raises(ConfigError, match=r"api_key: must not contain control characters such as '\\n'"):
        ServeOptions(model_id="m", api_key=f"{KEY}\n{KEY}")


@pytest.mark.parametrize("configured", ["", "\n", " \r\n"], ids=repr)
def test_serve_with_an_empty_key_in_the_environment_exits_2_before_anything_starts(configured, monkeypatch, capsys):
    monkeypatch.setenv(ENV_API_KEY, configured)
    assert main(["serve", "--model", "m", "--port", "0", "--no-plan-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "api_key: must not be empty" in err and ENV_API_KEY in err
    assert "bootstrap serve:" not in err and "Traceback" not in err  # refused before the announcement


async def test_with_a_key_every_route_but_the_probes_needs_it():
    async with client(ServeOptions(model_id="m", api_key=KEY)) as http:
        refused = {path: (await http.get(path)).status_code for path in GUARDED}
        wrong = {path: (await http.get(path, headers={"Authorization": "Bearer x"})).status_code for path in GUARDED}
        probes = {path: (await http.get(path)).status_code for path in ("/health", "/ready", "/metrics")}
        docs = [(await http.get(path, headers=RIGHT)).status_code for path in ("/openapi.json", "/docs", "/redoc")]
    assert refused == wrong == dict.fromkeys(GUARDED, 401)
    assert probes == {"/health": 200, "/ready": 503, "/metrics": 200}  # 503: not ready yet, but not 401
    assert docs == [200, 200, 200]


async def test_without_a_key_the_docs_stay_open():
    async with client(ServeOptions(model_id="m")) as http:
        assert (await http.get("/openapi.json")).status_code == 200 and (await http.get("/docs")).status_code == 200


def test_the_app_says_once_that_a_key_is_required_and_never_the_key(caplog):
    with caplog.at_level(logging.DEBUG):
        create_app(ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m", api_key=KEY)))
    said = [r.getMessage() for r in caplog.records if "API key is required" in r.getMessage()]
    assert len(said) == 1 and "/health" in said[0]
    assert not any(KEY in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        create_app(ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m")))
    assert not any("API key" in r.getMessage() for r in caplog.records)
