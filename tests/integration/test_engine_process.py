"""The engine in a process of its own (``serve``'s default): torch is mapped in the engine's process
and not in the server's; a SIGKILL of the engine ends the stream in flight with an OpenAI-shaped
error, says the status and the engine's last line in the log, and exits the server with 1; a
SIGSTOP is named by ``/health`` (``--engine-timeout``) until a SIGCONT; after the server's SIGTERM
no process is left, and a SIGKILL of the server takes the engine with it. A real server on the
CPU whose every step sleeps 100 ms, so a stream is still running when the test acts on the engine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
from helpers.serve_backends import plugin_module
from helpers.serve_process import ServeProcess, children
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint

LONG = {"prompt": "w5 w37 w33 w9 w64 w42 w7", "max_tokens": 400, "temperature": 0, "stream": True}


def start(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[ServeProcess, int]:
    checkpoint = save_checkpoint("llama", tmp / "llama", CHAT_TEMPLATE)
    backend = plugin_module(tmp, step_delay_s=0.1)
    argv = ("--model", str(checkpoint), "--no-plan-cache", "--backend-factory", backend, *flags)
    server = ServeProcess(tmp / "serve.log", *argv, pythonpath=(tmp,), env=env)
    server.wait_state("ready")
    [engine] = children(server.proc)
    LONG["model"] = str(checkpoint)
    return server, engine


def mapped(pid: int, library: str) -> bool:
    return library in Path(f"/proc/{pid}/maps").read_text()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"  # exited, not reaped yet


def wait_for(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(what)


def test_the_engine_runs_apart_and_nothing_is_left_after_sigterm(tmp_path):
    server, engine = start(tmp_path)
    try:
        assert b"engine_process" in Path(f"/proc/{engine}/cmdline").read_bytes()
        assert mapped(engine, "libtorch") and not mapped(server.proc.pid, "libtorch")
        body = {**LONG, "max_tokens": 3, "stream": False}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 3
        assert server.signal(signal.SIGTERM) == 0
    finally:
        server.stop()
    assert gone(engine)
    assert f"engine process {engine}: backend ready" in server.log() and "no thread left" in server.log()


def test_a_killed_engine_ends_the_stream_with_an_error_and_the_server_exits_1(tmp_path):
    server, engine = start(tmp_path)
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(engine, signal.SIGKILL)
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        status = server.proc.wait(60)
    finally:
        server.stop()
    assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "engine_error" and f"(pid {engine}) exited with status -9" in error["message"]
    assert status == 1
    log = server.log()
    said = (
        f"the engine's process (pid {engine}) exited with status -9; its last line: INFO:     engine process {engine}: "
    )
    assert said in log
    assert "Traceback" not in log


def test_a_stopped_engine_is_named_by_health_until_it_continues(tmp_path):
    server, engine = start(tmp_path, "--engine-timeout", "0.5")
    try:
        body = {**LONG, "max_tokens": 30}  # 3 s of steps: still running when the engine stops
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(engine, signal.SIGSTOP)
            try:
                stalled = wait_for(
                    lambda: (r := httpx.get(f"{server.url}/health", timeout=10)).status_code == 503 and r,
                    "/health never named the stopped engine",
                )
            finally:
                os.kill(engine, signal.SIGCONT)
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        healthy = httpx.get(f"{server.url}/health", timeout=10)
        assert server.signal(signal.SIGTERM) == 0
    finally:
        server.stop()
    body = stalled.json()
    assert (
        body["status"] == "engine_stalled" and "while 1 request(s) wait on it (--engine-timeout 0.5)" in body["message"]
    )
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert healthy.status_code == 200 and gone(engine)


def test_a_server_whose_engine_never_answers_its_close_kills_it_and_exits_1(tmp_path):
    server, engine = start(tmp_path, "--engine-timeout", "0.5")
    try:
        os.kill(engine, signal.SIGSTOP)
        status = server.signal(signal.SIGTERM)
    finally:
        server.stop()
    assert status == 1 and gone(engine)
    said = f"the engine's process (pid {engine}) did not answer its close within 0.5 s (--engine-timeout): killed"
    assert said in server.log() and "no thread left" in server.log()


def test_the_engine_dies_with_a_killed_server_and_the_next_server_removes_its_folder(tmp_path, request):
    """A SIGKILLed server cannot remove its socket folder; the next one to start removes it
    (nobody listens on its sockets), and leaves alone a folder that holds more than sockets."""
    temp = Path(tempfile.mkdtemp(prefix="be-"))  # short: the suite's workers' own paths leave the sockets no room
    request.addfinalizer(lambda: shutil.rmtree(temp, ignore_errors=True))
    (temp / "bootstrap-engine-mine").mkdir(parents=True)
    (temp / "bootstrap-engine-mine" / "notes.txt").write_text("not a socket")
    server, engine = start(tmp_path, env={"TMPDIR": str(temp)})
    try:
        [left] = [p for p in temp.iterdir() if p.name != "bootstrap-engine-mine"]
        server.proc.kill()
        server.proc.wait(60)
        wait_for(lambda: gone(engine), "the engine outlived its server")
        assert {"calls", "notes"} <= {p.name for p in left.iterdir()}  # nothing ran after the SIGKILL
    finally:
        server.stop()
    again, _ = start(tmp_path, env={"TMPDIR": str(temp)})
    try:
        assert not left.exists()
        [own] = [p for p in temp.iterdir() if p.name != "bootstrap-engine-mine"]  # its own, live: kept
        assert own.name.startswith("bootstrap-engine-") and (temp / "bootstrap-engine-mine" / "notes.txt").is_file()
    finally:
        again.stop()


def test_an_executor_the_engine_cannot_serve_fails_the_start_naming_why(tmp_path):
    """Every stage done, but the engine's process cannot make the channel to the executor (its
    ``engine_stats`` raises): the start fails with the cause, instead of ``bootstrapping`` for
    ever, and the server still exits 0 on SIGTERM."""
    checkpoint = save_checkpoint("llama", tmp_path / "llama", CHAT_TEMPLATE)
    backend = plugin_module(tmp_path, stats_fail=True)
    argv = ("--model", str(checkpoint), "--no-plan-cache", "--backend-factory", backend)
    server = ServeProcess(tmp_path / "serve.log", *argv, pythonpath=(tmp_path,))
    try:
        body = server.wait_state("failed", "ready", timeout=120)
        assert body["state"] == "failed" and "injected failure in engine_stats" in body["error"], body
        assert server.signal(signal.SIGTERM) == 0
    finally:
        server.stop()


def test_the_engine_stays_in_the_server_s_process_when_asked(tmp_path):
    checkpoint = save_checkpoint("llama", tmp_path / "llama", CHAT_TEMPLATE)
    server = ServeProcess(tmp_path / "serve.log", "--model", str(checkpoint), "--no-plan-cache", "--engine-in-process")
    try:
        server.wait_state("ready")
        assert children(server.proc) == [] and mapped(server.proc.pid, "libtorch")
    finally:
        server.stop()


def test_a_failed_start_its_retry_and_the_live_operations_cross_to_the_engine(qwen, tmp_path):
    """A stage's failure in the engine reaches ``/ready`` in its words and is retried there; a
    swap drains a stream in flight (the drain runs in the server) and the new model answers; a
    sleep and a wake; the server never maps torch through any of it."""
    checkpoint = save_checkpoint("llama", tmp_path / "llama", CHAT_TEMPLATE)
    backend = plugin_module(tmp_path, step_delay_s=0.05, fail_once=("build_final",))
    argv = ("--model", str(checkpoint), "--no-plan-cache", "--backend-factory", backend, "--drain-timeout", "60")
    server = ServeProcess(tmp_path / "serve.log", *argv, pythonpath=(tmp_path,))
    url = server.url
    try:
        failed = server.wait_state("failed")
        assert httpx.post(f"{url}/v1/bootstrap/retry", timeout=10).status_code == 202
        server.wait_state("ready")
        body = {**LONG, "model": str(checkpoint), "max_tokens": 40}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            swapped = httpx.post(f"{url}/v1/bootstrap/swap", json={"model": str(qwen)}, timeout=120)
            drained = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        after = {**body, "model": str(qwen), "stream": False, "prompt": [5, 37, 33, 9]}  # ids: any tokenizer
        reply = httpx.post(f"{url}/v1/completions", json=after, timeout=60)
        slept = httpx.post(f"{url}/v1/bootstrap/sleep", json={"level": 2}, timeout=60)
        woken = httpx.post(f"{url}/v1/bootstrap/wake", timeout=120)
        again = httpx.post(f"{url}/v1/completions", json=after, timeout=60)
        refused = httpx.post(f"{url}/v1/bootstrap/sleep", json={"level": 3}, timeout=10)
        assert not mapped(server.proc.pid, "libtorch")
        assert server.signal(signal.SIGTERM) == 0
    finally:
        server.stop()
    assert failed["error"].startswith("bootstrap failed at stage 'final_build' after ")
    assert "injected failure in build_final (test)" in failed["error"]
    assert swapped.status_code == 200 and swapped.json()["model"] == str(qwen) and swapped.json()["cut_short"] == 0
    assert json.loads(drained[-2])["choices"][0]["finish_reason"] == "length" and drained[-1] == "[DONE]"
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1, reply.text
    assert (slept.status_code, slept.json()["state"], woken.status_code, woken.json()["state"]) == (
        200,
        "asleep",
        200,
        "ready",
    )
    assert again.json()["choices"][0]["text"] == reply.json()["choices"][0]["text"]  # the same weights, read again
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "level"
