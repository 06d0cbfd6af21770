"""The serve app in process, before any bootstrap (no lifespan runs, so no torch): probes, the
503 before ready, the error shape, the API key; and the command's option checks."""

from __future__ import annotations

import argparse

import httpx
import pytest

from bootstrap.cli.serve import ENV_API_KEY, serve_options
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.serve.app import create_app
from bootstrap.serve.errors import APIError
from bootstrap.serve.openai.inputs import check_length
from bootstrap.serve.state import ServeOptions, ServeState
from bootstrap.stages import STAGE_IDS

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def app_client(api_key: str | None = None) -> httpx.AsyncClient:
    state = ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m", api_key=api_key))
    transport = httpx.ASGITransport(app=create_app(state))
    return httpx.AsyncClient(transport=transport, base_url="http://serve")


async def test_before_ready_probes_answer_and_generation_is_503_with_retry_after():
    async with app_client() as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        ready = await http.get("/ready")
        assert ready.status_code == 503 and ready.json()["state"] == "starting" and "Retry-After" in ready.headers
        chat = await http.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 503 and chat.headers["Retry-After"] == "1"
        assert chat.json()["error"] == {
            "message": chat.json()["error"]["message"],
            "type": "service_unavailable",
            "param": None,
            "code": "not_ready",
        }
        assert (await http.get("/v1/models")).status_code == 503
        stages = (await http.get("/v1/bootstrap")).json()["stages"]  # the engine is not imported yet
        assert [(s["id"], s["state"]) for s in stages] == [(stage, "pending") for stage in STAGE_IDS]
        assert (await http.post("/v1/bootstrap/retry")).status_code == 409
        assert "bootstrap_phase" in (await http.get("/metrics")).text


async def test_a_malformed_body_is_a_400_naming_the_field_even_before_ready():
    async with app_client() as http:
        response = await http.post("/v1/chat/completions", json={**CHAT, "top_p": 0})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "top_p"
    assert error["message"] == "top_p: Input should be greater than 0 (got 0)"


async def test_the_api_key_guards_v1_routes_only():
    async with app_client(api_key="s3cret") as http:
        missing = await http.get("/v1/bootstrap")
        wrong = await http.get("/v1/bootstrap", headers={"Authorization": "Bearer s3creT"})
        right = await http.get("/v1/bootstrap", headers={"Authorization": "Bearer s3cret"})
        open_probe = await http.get("/ready")
    assert missing.status_code == wrong.status_code == 401 and right.status_code == 200
    assert wrong.json()["error"]["code"] == "invalid_api_key" and missing.headers["WWW-Authenticate"] == "Bearer"
    assert open_probe.status_code == 503  # not 401: probes stay open


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


def test_the_api_key_comes_from_the_flag_before_the_environment(monkeypatch):
    config = BootstrapConfig(model="m")
    monkeypatch.setenv(ENV_API_KEY, "from-env")
    assert serve_options(args(), config).api_key == "from-env"
    assert serve_options(args(api_key="from-flag"), config).api_key == "from-flag"
    monkeypatch.delenv(ENV_API_KEY)
    assert serve_options(args(), config).api_key is None


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"port": 70000}, "port: must be in [0, 65535] (got 70000)"),
        ({"shutdown_timeout": -1.0}, "shutdown_timeout: must be >= 0 seconds (got -1.0)"),
        ({"api_key": " "}, "api_key: must not be empty (from --api-key)"),
        (
            {"request_trace_ratio": -0.1},
            "request_trace_ratio: must be >= 0 (got -0.1); allowed: a finite number in [0, 1]",
        ),
    ],
)
def test_bad_serve_options_name_the_field_and_range(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        serve_options(args(**overrides), BootstrapConfig(model="m"))


def test_lengths_beyond_max_seq_len_name_both_numbers():
    assert check_length(10, None, "max_tokens", 64) == 54  # default: what max_seq_len leaves
    with pytest.raises(APIError) as too_long:
        check_length(10, 60, "max_completion_tokens", 64)
    assert too_long.value.param == "max_completion_tokens" and too_long.value.code == "context_length_exceeded"
    assert "prompt (10 tokens) + max_completion_tokens (60) = 70 exceeds max_seq_len (64)" in too_long.value.message
    with pytest.raises(APIError, match=r"prompt \(64 tokens\) leaves no room to generate within max_seq_len \(64\)"):
        check_length(64, None, "max_tokens", 64)


def test_bad_config_flags_exit_2_before_the_port_opens(capsys):
    from bootstrap.cli.main import main

    assert main(["serve", "--model", "m", "--max-batch-size", "0", "--port", "0"]) == 2
    assert "max_batch_size" in capsys.readouterr().err
    assert main(["serve", "--model", "m", "--port", "99999"]) == 2
    assert "port: must be in [0, 65535] (got 99999)" in capsys.readouterr().err
    assert main(["serve", "--model", "m", "--backend", "trtllm"]) == 2
    assert "backend: 'trtllm' is not served yet" in capsys.readouterr().err


def test_stage_rows_show_retrying_skipped_and_failed_stages():
    from types import SimpleNamespace

    from bootstrap.pipeline.events import EventHub, StageEvent
    from bootstrap.serve.startup.progress import bootstrap_view, ready_view

    hub = EventHub(["load_model", "estimation_build", "profiling", "final_build"])
    events = [
        ("load_model", "started", ""),
        ("load_model", "done", ""),
        ("estimation_build", "started", ""),
        ("estimation_build", "skipped", "plan-cache"),
        ("profiling", "started", ""),
        ("profiling", "attempt_failed", "OutOfMemoryError: x"),
        ("profiling", "retrying", "max_num_tokens: 2048 -> 1024"),
    ]
    for stage, kind, message in events:
        hub.publish(StageEvent(stage, kind, 1, message))
    state = ServeState(BootstrapConfig(model="m"), ServeOptions(model_id="m"), phase="bootstrapping")
    pipeline = SimpleNamespace(status=hub.status, hub=hub, artifacts={})
    state.boot = SimpleNamespace(
        pipeline=pipeline, hub=hub, asleep=0, operations=[], stage_status=lambda: list(hub.status.values()), plan=dict
    )
    rows = {row["id"]: row for row in bootstrap_view(state)["stages"]}
    assert [rows[s]["state"] for s in rows] == ["done", "skipped", "retrying", "pending"]
    assert rows["estimation_build"]["skip_reason"] == "plan-cache"
    assert rows["profiling"]["last_attempt_error"] == "OutOfMemoryError: x" and rows["profiling"]["attempts"] == 1
    assert rows["profiling"]["retry_change"] == "max_num_tokens: 2048 -> 1024"
    ready = ready_view(state)
    assert (ready["stage"], ready["stage_state"], ready["ready"]) == ("profiling", "retrying", False)
    hub.publish(StageEvent("profiling", "failed", 2, "OutOfMemoryError: y"))
    assert bootstrap_view(state)["current_stage"] == "profiling" and ready_view(state)["stage_state"] == "failed"


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", '{"model": "m", "prompt": "w4 \\ud800"}', "prompt"),
        ("/v1/completions", '{"model": "m", "prompt": ["ok", "w4 \\udfff x"]}', "prompt"),
        ("/v1/completions", '{"model": "m", "prompt": "ok", "stop": ["\\ud83d"]}', "stop"),
        (
            "/v1/chat/completions",
            '{"model": "m", "messages": [{"role": "user", "content": "a \\ud800"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            None,
        ),  # a union: both branches are reported, so no single param
        (
            "/v1/chat/completions",
            '{"model": "m", "user": "\\udc00", "messages": [{"role": "user", "content": "a"}]}',
            "user",
        ),
    ],
)
async def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_it(route, body, param):
    """Valid JSON, but not text UTF-8 (or any tokenizer) can encode: refused before any work."""
    async with app_client() as http:
        response = await http.post(route, content=body, headers={"content-type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error", error
    assert error["param"] == param and "lone surrogate" in error["message"], error
    async with app_client() as http:  # a proper pair (an emoji) is text
        fine = await http.post(
            "/v1/completions",
            content='{"model": "m", "prompt": "\\ud83d\\ude00"}',
            headers={"content-type": "application/json"},
        )
    assert fine.status_code == 503  # not ready yet: it passed validation


def test_requests_are_traced_at_the_flags_ratio_only_when_spans_go_somewhere(tmp_path):
    from bootstrap.serve.request_trace import RequestTracing

    config = BootstrapConfig(model="m")
    traced = serve_options(args(request_trace_ratio=0.25, trace_file=tmp_path / "t.jsonl"), config)
    untraced = serve_options(args(request_trace_ratio=0.25), config)
    assert traced.request_trace_ratio == 0.25 and traced.traces and not untraced.traces

    def tracing(options):
        app = create_app(ServeState(config, options))
        return [m.kwargs for m in app.user_middleware if m.cls is RequestTracing]

    [kwargs] = tracing(traced)
    assert kwargs["ratio"] == 0.25 and tracing(untraced) == []
    with pytest.raises(ConfigError, match=r"request_trace_ratio: must be a number in \[0, 1\] \(got 2\)"):
        ServeOptions(model_id="m", request_trace_ratio=2)
