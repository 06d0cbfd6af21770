"""Which browsers' requests the serve app takes (issue 36, S): on a loopback address no other
site and no foreign ``Host`` (DNS rebinding), unless ``--allowed-origins`` names it; with a key,
Basic credentials from another site change nothing. In process, before any bootstrap."""

from __future__ import annotations

import base64

import httpx
import pytest

from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.serve.app import create_app
from bootstrap.serve.state import ServeOptions, ServeState

COMPLETION_FORM = b'{"model": "m", "prompt": "hi"}'  # what a cross-site <form enctype="text/plain"> can send
EVIL = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}


def client(host: str | None = "127.0.0.1", **options: object) -> httpx.AsyncClient:
    state = ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m", host=host, **options))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://127.0.0.1:8000")


def code(response: httpx.Response) -> str | None:
    return response.json()["error"]["code"] if response.status_code == 403 else None


async def test_a_loopback_server_refuses_a_cross_site_form_post():
    form = {"Content-Type": "text/plain"}
    async with client() as http:
        posted = await http.post("/v1/completions", content=COMPLETION_FORM, headers={**form, **EVIL})
        no_origin = await http.post("/v1/completions", content=COMPLETION_FORM, headers={"Sec-Fetch-Site": "same-site"})
        origin_only = await http.post("/v1/bootstrap/retry", headers={"Origin": "http://localhost:3000"})
        own = await http.post("/v1/bootstrap/retry", headers={"Origin": "http://127.0.0.1:8000"})
    assert code(posted) == code(no_origin) == code(origin_only) == "cross_site"
    assert own.status_code == 409  # its own page: served (nothing to retry yet)


@pytest.mark.parametrize("path", ["/", "/v1/engine", "/v1/bootstrap", "/health"])
async def test_a_loopback_server_refuses_a_foreign_host_name(path):
    async with client() as http:
        rebound = await http.get(path, headers={"Host": "evil.example:8000"})
        bare = await http.get(path, headers={"Host": "evil.example"})
    assert code(rebound) == code(bare) == "foreign_host"
    assert "Host 'evil.example:8000' is not this server's" in rebound.json()["error"]["message"]


@pytest.mark.parametrize(
    ("bound", "host"),
    [
        ("127.0.0.1", "localhost"),
        ("127.0.0.1", "LOCALHOST:8000"),
        ("127.0.0.1", "127.0.0.1:1"),
        ("127.0.0.1", "[::1]:8000"),
        ("127.0.0.2", "127.0.0.2:8000"),
        ("::1", "[::1]"),
        ("localhost", "localhost:8000"),
    ],
)
async def test_loopback_host_names_are_served(bound, host):
    async with client(bound) as http:
        assert (await http.get("/health", headers={"Host": host})).status_code == 200


@pytest.mark.parametrize("host", ["127.0.0.1.evil.example", "localhost:80x", "::1", "", "127.0.0.2"])
async def test_near_loopback_host_names_are_refused(host):
    async with client() as http:
        assert code(await http.get("/health", headers={"Host": host})) == "foreign_host"


async def test_an_allowed_origin_is_served_with_cors():
    site = "http://app.example:3000"
    async with client(allowed_origins=(site.upper(),)) as http:
        preflight = await http.options(
            "/v1/completions",
            headers={"Origin": site, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x"},
        )
        posted = await http.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"Origin": site})
        proxied = await http.get("/health", headers={"Host": "app.example"})  # a proxy keeping the page's Host
        other = await http.post("/v1/completions", json={}, headers={"Origin": "http://app.example:3001"})
    assert preflight.status_code == 200 and preflight.headers["Access-Control-Allow-Origin"] == site
    assert posted.status_code == 503 and posted.headers["Access-Control-Allow-Origin"] == site  # not ready: served
    assert proxied.status_code == 200 and code(other) == "cross_site"


async def test_a_server_on_another_address_takes_any_host_but_no_other_site():
    async with client("0.0.0.0") as http:
        posted = await http.post("/v1/completions", content=COMPLETION_FORM, headers={"Host": "evil.example", **EVIL})
        named = await http.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"Host": "gpu.lan"})
    assert code(posted) == "cross_site"  # issue 54: the site checks apply on every address
    assert named.status_code == 503  # any Host: not ready yet, served, as docs/serving.md says


@pytest.mark.parametrize("site", ["same-site", "cross-site"])
async def test_basic_credentials_from_another_site_without_origin_change_nothing(site):
    basic = "Basic " + base64.b64encode(b"anyone:s3cret").decode()
    async with client(None, api_key="s3cret") as http:  # no host: only the key check stands
        forged = await http.post("/v1/bootstrap/retry", headers={"Authorization": basic, "Sec-Fetch-Site": site})
        own = await http.post("/v1/bootstrap/retry", headers={"Authorization": basic, "Sec-Fetch-Site": "same-origin"})
    assert code(forged) == "cross_site" and own.status_code == 409


@pytest.mark.parametrize("bad", ["http://a.example/", "ftp://a.example", "a.example", "http://a.example:0", "*", ""])
def test_a_bad_allowed_origin_names_the_field(bad):
    with pytest.raises(ConfigError, match=r"^allowed_origins: .* is not an origin \(allowed: comma-separated"):
        ServeOptions(model_id="m", allowed_origins=(bad,))


def test_a_bad_allowed_origins_flag_exits_2_with_one_line(capsys):
    from bootstrap.cli.main import main

    bad = ["--allowed-origins", "http://ok.example,http://x/", "--shutdown-timeout", "-1"]  # the later check: no hang
    assert main(["serve", "--model", "m", "--port", "0", *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bootstrap: allowed_origins: 'http://x/' is not an origin")
