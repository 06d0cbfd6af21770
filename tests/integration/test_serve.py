"""``bootstrap serve`` end to end: the real server in a subprocess on a free localhost port, a
tiny checkpoint with a chat template, the official ``openai`` client, and raw HTTP (httpx) for
probes, metrics and errors.

Stages are held or failed with a test-only backend passed on the command line
(``serve_backends``): a FIFO gate keeps one stage running until the test opens it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers.serve_backends import open_gate, plugin_module
from helpers.serve_process import ServeProcess, metric, metric_or_0, wait_metric

from bootstrap.cli.main import main
from bootstrap.stages import STAGE_IDS

PROMPT = "w5 w37 w33 w9 w64 w42 w7"  # 7 tokens (w0, w1, w2 are special: no word here starts with them)
CHAT = "w33 w44 w55"
KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """One ready server shared by the tests that only send requests."""
    tmp = tmp_path_factory.mktemp("served")
    server = ServeProcess(
        tmp / "serve.log", "--model", str(checkpoint), "--plan-cache", str(tmp / "plans"), "--max-batch-size", "16"
    )
    server.wait_state("ready")
    yield server
    server.stop()


def client(server: ServeProcess, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


# ---- the openai client ------------------------------------------------------------------------


def test_chat_completion_through_the_openai_client(served, checkpoint):
    reply = client(served).chat.completions.create(
        model=str(checkpoint), messages=[{"role": "user", "content": CHAT}], max_tokens=12, temperature=0
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert reply.usage.prompt_tokens == 5  # w4 w33 w44 w55 w5: the template's user and assistant markers
    assert 1 <= reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_equals_the_whole_answer(served, checkpoint):
    messages = [{"role": "user", "content": CHAT}]
    args = dict(model=str(checkpoint), messages=messages, max_completion_tokens=20, temperature=0)
    whole = client(served).chat.completions.create(**args)
    chunks = list(client(served).chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content and finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_whole_and_streamed(served, checkpoint):
    args = dict(model=str(checkpoint), prompt=PROMPT, max_tokens=10, temperature=0)
    whole = client(served).completions.create(**args)
    assert whole.object == "text_completion" and whole.usage.prompt_tokens == 7
    chunks = list(client(served).completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_seeded_sampling_repeats_and_stop_strings_end_the_text(served, checkpoint):
    args = dict(model=str(checkpoint), prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    first, again = (client(served).completions.create(**args).choices[0].text for _ in range(2))
    assert first == again
    stop = first.split()[2]  # the third word sampled
    cut = client(served).completions.create(**args, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == first[: first.index(stop)]


def test_token_id_prompts_and_the_model_list(served, checkpoint):
    ids = client(served).completions.create(model=str(checkpoint), prompt=[5, 17, 33], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3
    models = client(served).models.list()
    assert [m.id for m in models.data] == [str(checkpoint)]


def test_greedy_output_through_the_server_equals_bootstrap_run(served, checkpoint, capsys, tmp_path):
    for flag, text in (("--prompt", PROMPT), ("--chat", CHAT)):
        assert (
            main(
                [
                    "run",
                    "--device",
                    "cpu",
                    "--json",
                    "--model",
                    str(checkpoint),
                    flag,
                    text,
                    "--max-tokens",
                    "24",
                    "--temperature",
                    "0",
                    "--plan-cache",
                    str(tmp_path),
                ]
            )
            == 0
        )
        run = json.loads(capsys.readouterr().out)
        if flag == "--prompt":
            answer = client(served).completions.create(model=str(checkpoint), prompt=text, max_tokens=24, temperature=0)
            served_text, usage = answer.choices[0].text, answer.usage
        else:
            answer = client(served).chat.completions.create(
                model=str(checkpoint), messages=[{"role": "user", "content": text}], max_tokens=24, temperature=0
            )
            served_text, usage = answer.choices[0].message.content, answer.usage
        assert served_text == run["text"] and usage.completion_tokens == len(run["token_ids"])
        assert answer.choices[0].finish_reason == run["finish_reason"]


# ---- errors -----------------------------------------------------------------------------------


def post(server: ServeProcess, path: str, body: object, **kwargs) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=30, **kwargs)


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_errors_come_in_openai_shape_and_name_the_field(served, checkpoint):
    model = str(checkpoint)
    chat = {"model": model, "messages": [{"role": "user", "content": CHAT}]}
    cases = {
        "malformed": (post(served, "/v1/chat/completions", "{not json"), 400, None, "not valid JSON"),
        "temperature": (
            post(served, "/v1/chat/completions", {**chat, "temperature": 5}),
            400,
            "temperature",
            "less than or equal to 2",
        ),
        "n": (post(served, "/v1/chat/completions", {**chat, "n": 17}), 400, "n", "less than or equal to 16"),
        "missing messages": (post(served, "/v1/chat/completions", {"model": model}), 400, "messages", "required"),
        "unknown field": (
            post(served, "/v1/completions", {"model": model, "prompt": "w5", "logit_bias": {}}),
            400,
            "logit_bias",
            "Extra inputs",
        ),
        "model": (
            post(served, "/v1/completions", {"model": "gpt-4o", "prompt": "w5"}),
            404,
            "model",
            "'gpt-4o' does not exist",
        ),
        "token ids": (post(served, "/v1/completions", {"model": model, "prompt": [5, 9999]}), 400, None, "[0, 256)"),
        "route": (httpx.get(f"{served.url}/v1/nothing-here"), 404, None, "Not Found"),
    }
    for name, (response, status, param, words) in cases.items():
        error = error_of(response)
        assert response.status_code == status, (name, error)
        assert error["param"] == param and words in error["message"], (name, error)


def test_prompt_plus_max_tokens_beyond_max_seq_len_names_both_numbers(served, checkpoint):
    response = post(served, "/v1/completions", {"model": str(checkpoint), "prompt": PROMPT, "max_tokens": 600})
    error = error_of(response)
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "prompt (7 tokens) + max_tokens (600) = 607 exceeds max_seq_len (512)" in error["message"]
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client(served).chat.completions.create(
            model=str(checkpoint), messages=[{"role": "user", "content": CHAT}], max_completion_tokens=510
        )


def test_retry_is_409_when_nothing_failed(served):
    response = httpx.post(f"{served.url}/v1/bootstrap/retry")
    assert response.status_code == 409 and error_of(response)["code"] == "nothing_to_retry"


# ---- bootstrap state and metrics --------------------------------------------------------------


def test_bootstrap_state_lists_every_stage_and_the_plan(served):
    view = httpx.get(f"{served.url}/v1/bootstrap").json()
    assert view["state"] == "ready" and view["time_to_ready_s"] > 0
    assert [s["id"] for s in view["stages"]] == list(STAGE_IDS)
    ran = [s for s in view["stages"] if s["id"] != "warmup"]  # skipped on the CPU: no CUDA graphs
    assert all(s["state"] == "done" and s["attempts"] == 1 and s["duration_s"] >= 0 for s in ran)
    assert next(s["state"] for s in view["stages"] if s["id"] == "warmup") == "skipped"
    assert view["plan"]["max_seq_len"] == 512 and view["plan"]["kv_tokens"] > 0


def test_bootstrap_events_replay_the_progress_and_end_when_ready(served):
    with httpx.stream("GET", f"{served.url}/v1/bootstrap/events", timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert kinds[-1] == "ready" and events[-1]["ready"] is True
    done = [e["stage"] for e in events[:-1] if e["kind"] == "done"]
    assert done == [s for s in STAGE_IDS if s != "warmup"] and all(k == "stage" for k in kinds[:-1])
    assert [e["stage"] for e in events[:-1] if e["kind"] == "skipped"] == ["warmup"]  # no CUDA graphs on the CPU


def test_metrics_cover_the_bootstrap_the_kv_cache_and_requests(served, checkpoint):
    client(served).completions.create(model=str(checkpoint), prompt=PROMPT, max_tokens=4, temperature=0)
    page = httpx.get(f"{served.url}/metrics").text
    for stage in STAGE_IDS:
        if stage != "warmup":  # skipped on the CPU
            assert metric(page, "bootstrap_stage_attempts", stage=stage) == 1
        assert metric(page, "bootstrap_stage_duration_seconds", stage=stage) >= 0
    assert metric(page, "bootstrap_time_to_ready_seconds") > 0 and metric(page, "bootstrap_phase", phase="ready") == 1
    assert metric(page, "bootstrap_kv_capacity_blocks") > 0 and metric(page, "bootstrap_kv_blocks_used") == 0
    assert metric(page, "bootstrap_requests_running") == metric(page, "bootstrap_requests_waiting") == 0
    assert metric(page, "bootstrap_requests_total", endpoint="completion", finish_reason="length") >= 1
    assert metric(page, "bootstrap_time_to_first_token_seconds_count", endpoint="completion") >= 1
    assert metric(page, "bootstrap_request_latency_seconds_count", endpoint="completion") >= 1
    assert metric(page, "bootstrap_generation_tokens_total") >= 4


def test_64_concurrent_chat_requests_half_streaming_all_complete(served, checkpoint):
    async def one(api: openai.AsyncOpenAI, i: int) -> tuple[str, int, str]:
        messages = [{"role": "user", "content": f"w{10 + i % 50} w{60 + i % 40}"}]
        if i % 2:
            stream = await api.chat.completions.create(
                model=str(checkpoint),
                messages=messages,
                max_tokens=16,
                stream=True,
                stream_options={"include_usage": True},
                seed=i,
            )
            chunks = [c async for c in stream]
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, chunks[-1].usage.completion_tokens, finish
        reply = await api.chat.completions.create(model=str(checkpoint), messages=messages, max_tokens=16, seed=i)
        return reply.choices[0].message.content, reply.usage.completion_tokens, reply.choices[0].finish_reason

    async def all_of_them() -> list[tuple[str, int, str]]:
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300) as api:
            return await asyncio.gather(*(one(api, i) for i in range(64)))

    before = httpx.get(f"{served.url}/metrics").text
    results = asyncio.run(all_of_them())
    assert len(results) == 64
    assert all(1 <= tokens <= 16 and finish in ("stop", "length") for _, tokens, finish in results)
    assert all(text for text, tokens, finish in results if finish == "length")
    page = httpx.get(f"{served.url}/metrics").text
    ended = sum(
        metric_or_0(page, "bootstrap_requests_total", endpoint="chat", finish_reason=r) for r in ("stop", "length")
    )
    ended_before = sum(
        metric_or_0(before, "bootstrap_requests_total", endpoint="chat", finish_reason=r) for r in ("stop", "length")
    )
    assert ended - ended_before == 64 and metric(page, "bootstrap_kv_blocks_used") == 0
    assert metric(page, "bootstrap_requests_in_flight") == metric(page, "bootstrap_requests_running") == 0


# ---- a held bootstrap: readiness, key, failure and retry ---------------------------------------


def test_ready_follows_a_held_stage_then_a_failure_then_a_retry(checkpoint, tmp_path):
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    backend = plugin_module(tmp_path, gate=str(gate), gated="load_model", fail_once=("build_final",))
    server = ServeProcess(
        tmp_path / "serve.log",
        "--model",
        str(checkpoint),
        "--no-plan-cache",
        "--backend-factory",
        backend,
        pythonpath=(tmp_path,),
        env={"BOOTSTRAP_API_KEY": KEY},
    )
    try:
        held = server.wait_stage("load_model")
        assert held["ready"] is False and held["state"] == "bootstrapping" and held["stage_state"] == "running"
        _health_is_fast_while_a_stage_holds(server)
        _key_and_readiness_guard_the_v1_routes(server)
        open_gate(gate)
        failed = server.wait_state("failed")
        assert failed["stage"] == "final_build" and "injected failure in build_final" in failed["error"]
        _retry_resumes_without_reloading_weights(server, checkpoint)
    finally:
        server.stop()


def _health_is_fast_while_a_stage_holds(server: ServeProcess) -> None:
    with httpx.Client(base_url=server.url) as http:
        for _ in range(5):
            started = time.perf_counter()
            assert http.get("/health").status_code == 200
            assert time.perf_counter() - started < 0.1  # the only timing assertion: the issue asks for it
        ready = http.get("/ready")
    assert ready.status_code == 503 and ready.headers["Retry-After"] == "1"
    assert ready.json()["stage"] == "load_model" and ready.json()["elapsed_s"] > 0


def _key_and_readiness_guard_the_v1_routes(server: ServeProcess) -> None:
    missing = httpx.get(f"{server.url}/v1/models")
    wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert missing.status_code == wrong.status_code == 401
    assert "missing API key" in error_of(missing)["message"] and error_of(wrong)["code"] == "invalid_api_key"
    with pytest.raises(openai.APIStatusError) as caught:
        client(server, KEY).chat.completions.create(model="any", messages=[{"role": "user", "content": "w5"}])
    assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"] == "1"
    assert caught.value.body["code"] == "not_ready"
    view = httpx.get(f"{server.url}/v1/bootstrap", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert {s["id"]: s["state"] for s in view["stages"]}["load_model"] == "running"
    assert httpx.post(f"{server.url}/v1/bootstrap/retry", headers={"Authorization": f"Bearer {KEY}"}).status_code == 409


def _retry_resumes_without_reloading_weights(server: ServeProcess, checkpoint: Path) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    view = httpx.get(f"{server.url}/v1/bootstrap", headers=auth).json()
    assert view["retryable"] and {s["id"]: s["state"] for s in view["stages"]}["final_build"] == "failed"
    response = httpx.post(f"{server.url}/v1/bootstrap/retry", headers=auth)
    assert response.status_code == 202 and response.json()["resumed_from"] == "final_build"
    server.wait_state("ready")
    with httpx.stream("GET", f"{server.url}/v1/bootstrap/events", headers=auth, timeout=30) as events:
        stages = [json.loads(line[6:]) for line in events.iter_lines() if line.startswith("data: ")][:-1]
    started = [e["stage"] for e in stages if e["kind"] == "started"]
    assert started.count("load_model") == 1 and started.count("final_build") == 2  # the weights stayed loaded
    reply = client(server, KEY).completions.create(model=str(checkpoint), prompt=PROMPT, max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens >= 1


def test_a_backend_that_cannot_be_loaded_ends_the_server_with_exit_2(tmp_path):
    server = ServeProcess(
        tmp_path / "serve.log", "--model", "random:smollm2-135m", "--backend-factory", "no_such_module:backend"
    )
    try:
        assert server.proc.wait(120) == 2
    finally:
        server.stop()
    assert "cannot start the bootstrap: ModuleNotFoundError: No module named 'no_such_module'" in server.log()


# ---- shutdown ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_bootstrap_rolls_back_and_exits_0(sig, checkpoint, tmp_path):
    gate, trace = tmp_path / "gate", tmp_path / "trace.jsonl"
    os.mkfifo(gate)
    backend = plugin_module(tmp_path, gate=str(gate), gated="build_estimation")
    server = ServeProcess(
        tmp_path / "serve.log",
        "--model",
        str(checkpoint),
        "--no-plan-cache",
        "--backend-factory",
        backend,
        "--trace-file",
        str(trace),
        pythonpath=(tmp_path,),
    )
    try:
        server.wait_stage("estimation_build")
        server.proc.send_signal(sig)
        open_gate(gate)  # the stage's blocking call ends; then the pipeline rolls back
        assert server.proc.wait(120) == 0, server.log()
    finally:
        server.stop()
    log = server.log()
    assert "bootstrap cancelled; completed stages were rolled back" in log and "no thread left" in log
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    root = next(s for s in spans if s["name"] == "bootstrap.pipeline")
    assert root["attributes"]["bootstrap.outcome"] == "cancelled"
    load = next(s for s in spans if s["name"] == "bootstrap.stage.load_model")
    assert load["attributes"]["bootstrap.outcome"] == "ok"  # done, then released by the rollback


@pytest.fixture(scope="module")
def slow_server(checkpoint, tmp_path_factory):
    """A ready server whose every forward step sleeps 100 ms: requests stay in flight for seconds."""
    tmp = tmp_path_factory.mktemp("slow")
    backend = plugin_module(tmp, step_delay_s=0.1)
    server = ServeProcess(
        tmp / "serve.log",
        "--model",
        str(checkpoint),
        "--no-plan-cache",
        "--backend-factory",
        backend,
        "--shutdown-timeout",
        "4",
        pythonpath=(tmp,),
    )
    server.wait_state("ready")
    yield server
    server.stop()


def test_a_client_that_disconnects_mid_stream_cancels_its_request(slow_server, checkpoint):
    body = {"model": str(checkpoint), "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{slow_server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # generating; now hang up
    wait_metric(slow_server, "bootstrap_requests_total", 1, endpoint="completion", finish_reason="abort")
    # the engine applies the cancel at its next step (at most one 100 ms step later), freeing every block
    wait_metric(slow_server, "bootstrap_kv_blocks_used", 0, timeout=5.0)
    wait_metric(slow_server, "bootstrap_requests_running", 0, timeout=5.0)


def test_sigterm_during_generation_lets_short_requests_finish_and_cuts_long_ones(slow_server, checkpoint):
    """Grace 4 s at 100 ms a step: the 10-token request (~1 s) finishes; the greedy long ones (the
    chat stops by itself after 134 tokens, the completion never before 400: 13 s and more) are
    cancelled with a final chunk; the non-streaming one gets its text so far."""
    chat = {"model": str(checkpoint), "messages": [{"role": "user", "content": CHAT}], "stream": True, "temperature": 0}
    completion = {"model": str(checkpoint), "prompt": PROMPT, "max_tokens": 400, "temperature": 0}
    requests = {
        "short": ("/v1/chat/completions", {**chat, "max_tokens": 10}),
        "long chat": ("/v1/chat/completions", {**chat, "max_tokens": 400}),
        "long completion": ("/v1/completions", {**completion, "stream": True}),
        "whole": ("/v1/completions", completion),
    }
    results: dict[str, list[str]] = {}
    threads = [
        threading.Thread(target=_read_all, args=(slow_server, path, body, results.setdefault(name, [])))
        for name, (path, body) in requests.items()
    ]
    for thread in threads:
        thread.start()
    wait_metric(slow_server, "bootstrap_requests_in_flight", 4)
    assert slow_server.signal() == 0, slow_server.log()
    for thread in threads:
        thread.join(60)
    finishes = {name: _finish(lines) for name, lines in results.items()}
    cut = {"long chat": "abort", "long completion": "abort", "whole": "abort"}
    assert finishes == {"short": "length", **cut}
    assert all(lines[-1] == "data: [DONE]" for name, lines in results.items() if name != "whole")
    assert "no thread left" in slow_server.log()


def _read_all(server: ServeProcess, path: str, body: dict, out: list[str]) -> None:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as response:
        out.extend(line for line in response.iter_lines() if line)


def _finish(lines: list[str]) -> str | None:
    if len(lines) == 1 and not lines[0].startswith("data: "):  # a whole (non-streaming) answer
        return json.loads(lines[0])["choices"][0]["finish_reason"]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return next((r for r in reasons if r), None)
