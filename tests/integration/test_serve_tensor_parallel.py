"""``bootstrap serve --tp 2`` on the CPU (gloo): two real ranks under torch's launcher, rank 0
serving and sending each step to rank 1. Its answers are one rank's (greedy, n > 1 with a seed,
logprobs, streaming; with a draft; on fp8 KV pools), live operations reach both ranks, 64
clients hanging up at random leave every counter at zero, a SIGTERM drains and ends every rank
with status 0, a killed rank ends the server with a line naming it, and two torchrun agents
(``--nnodes 2``) serve as one launcher."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from helpers.serve_process import ROOT, ServeProcess, children, metric, metric_or_0, rank_pids

ARGS = ("--max-num-tokens", "64", "--max-batch-size", "4", "--max-seq-len", "512", "--no-plan-cache")
PROMPT = "w5 w17 w33 w9 w100 w42 w7"
EXIT_BOUND_S = 60  # a clean stop takes seconds; the launcher's own wait before SIGKILL is 30 s


def serve(tmp: Path, model: Path, tp: int, *argv: str) -> ServeProcess:
    server = ServeProcess(tmp / f"serve-tp{tp}.log", "--model", str(model), "--tp", str(tp), *ARGS, *argv)
    try:
        server.wait_state("ready")
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def serving(tmp: Path, model: Path, *argv: str) -> Iterator[ServeProcess]:
    """``serve --tp 2``, stopped (and its ranks with it) however the test ends."""
    server = serve(tmp, model, 2, *argv)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def servers(llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-tp")
    one, two = serve(tmp, llama, 1, "--served-model-name", "m"), serve(tmp, llama, 2, "--served-model-name", "m")
    yield one, two
    for server in (one, two):
        server.stop()


def completion(server: ServeProcess, **body) -> dict:
    answer = httpx.post(f"{server.url}/v1/completions", json={"model": "m", "prompt": PROMPT, **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def streamed(server: ServeProcess, **body) -> str:
    text = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"model": "m", "prompt": PROMPT, "stream": True, **body},
        timeout=60,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def test_two_ranks_answer_as_one_greedy_sampled_with_logprobs_and_streamed(servers):
    one, two = servers
    greedy = {"max_tokens": 12, "temperature": 0, "logprobs": 2}
    a, b = completion(one, **greedy), completion(two, **greedy)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert b["choices"][0]["logprobs"]["tokens"] == a["choices"][0]["logprobs"]["tokens"]
    assert b["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        a["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4
    )
    sampled = {"max_tokens": 10, "temperature": 1.0, "n": 3, "seed": 7}  # forks share the prompt's blocks
    assert [c["text"] for c in completion(one, **sampled)["choices"]] == [
        c["text"] for c in completion(two, **sampled)["choices"]
    ]
    assert streamed(two, max_tokens=12, temperature=0) == a["choices"][0]["text"]
    long = {"prompt": " ".join(f"w{(7 * i) % 250}" for i in range(150)), "max_tokens": 8, "temperature": 0}
    assert completion(one, **long)["choices"] == completion(two, **long)["choices"]  # prefill in chunks of 64
    stats = httpx.get(f"{two.url}/v1/engine").json()["engine"]
    assert stats["running"] == stats["waiting"] == stats["kv_used_blocks"] == 0


def test_two_ranks_speculate_as_one_the_draft_s_proposals_sent_from_rank_0(servers, llama, tmp_path):
    one, _ = servers
    greedy = {"max_tokens": 16, "temperature": 0}
    expected = [completion(one, **greedy)["choices"][0]["text"] for _ in range(2)]
    with serving(tmp_path, llama, "--served-model-name", "m", "--draft-model", str(llama)) as drafted:
        assert [completion(drafted, **greedy)["choices"][0]["text"] for _ in range(2)] == expected
        forked = {"max_tokens": 8, "temperature": 0, "n": 2}  # the draft's pool forks as well
        assert completion(drafted, **forked)["choices"] == completion(one, **forked)["choices"]
        page = httpx.get(f"{drafted.url}/metrics").text
        assert metric(page, "bootstrap_spec_draft_tokens_accepted") > 0  # the draft is the target: kept


def test_two_ranks_on_fp8_kv_pools_with_a_draft_answer_as_one_and_keep_every_proposal(llama, tmp_path):
    """Every rank's target and draft pools in e4m3; forks copy e4m3 blocks on every rank."""
    fp8 = ("--served-model-name", "m", "--kv-cache-dtype", "fp8")
    greedy = {"max_tokens": 16, "temperature": 0, "n": 2}
    one = serve(tmp_path, llama, 1, *fp8)
    try:
        expected = completion(one, **greedy)["choices"]
    finally:
        one.stop()
    with serving(tmp_path, llama, *fp8, "--draft-model", str(llama)) as drafted:
        assert completion(drafted, **greedy)["choices"] == expected
        assert httpx.get(f"{drafted.url}/v1/engine").json()["engine"]["kv_dtype"] == "fp8"
        page = httpx.get(f"{drafted.url}/metrics").text
        proposed = metric(page, "bootstrap_spec_draft_tokens_proposed")
        assert proposed > 0 and metric(page, "bootstrap_spec_draft_tokens_accepted") == proposed


def test_the_launcher_and_its_ranks_listen_on_loopback_only(servers):
    """On one host the rendezvous store (the launcher's), the ranks' gloo pairs and the HTTP port
    are bound to loopback: nothing of ``serve --tp 2`` listens on 0.0.0.0 or ::."""
    _, two = servers
    ranks = rank_pids(two.proc)
    assert len(ranks) == 2
    listening = {
        (pid, sock.laddr.ip, sock.laddr.port)
        for pid in [two.proc.pid, *children(two.proc)]
        for sock in psutil.Process(pid).net_connections(kind="inet")
        if sock.status == psutil.CONN_LISTEN
    }
    assert {pid for pid, _, _ in listening} >= {two.proc.pid, *ranks}  # the store, the pairs, the HTTP port
    assert [s for s in listening if s[1] not in ("127.0.0.1", "::1")] == []


def test_sixty_four_clients_hanging_up_at_random_leave_every_counter_at_zero(servers):
    _, two = servers
    before = httpx.get(f"{two.url}/metrics").text
    answered = []

    def client(seed: int) -> None:
        pick = random.Random(seed)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": pick.randint(1, 40), "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{two.url}/v1/completions", json=body, timeout=120) as response:
            answered.append(response.status_code)
            hang_up_after = pick.choice([0, 1, 3, None])
            for count, _ in enumerate(response.iter_lines()):
                if hang_up_after is not None and count >= hang_up_after:
                    break  # the client goes mid-answer

    clients = [threading.Thread(target=client, args=(seed,)) for seed in range(64)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(120)
    assert answered == [200] * 64
    deadline = time.monotonic() + 30
    while (body := httpx.get(f"{two.url}/v1/engine").json())["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    engine = body["engine"]
    assert (body["in_flight"], engine["running"], engine["waiting"], engine["kv_used_blocks"]) == (0, 0, 0, 0)
    page = httpx.get(f"{two.url}/metrics").text
    counted = sum(
        metric_or_0(page, "bootstrap_requests_total", endpoint="completion", finish_reason=reason)
        - metric_or_0(before, "bootstrap_requests_total", endpoint="completion", finish_reason=reason)
        for reason in ("length", "stop", "abort", "error")
    )
    assert (
        counted == 64
        and metric_or_0(page, "bootstrap_requests_total", endpoint="completion", finish_reason="error") == 0
    )
    assert metric(page, "bootstrap_requests_in_flight") == 0
    assert completion(two, max_tokens=12, temperature=0)["choices"][0]["text"]  # still in step


def test_live_operations_reach_both_ranks(servers, llama):
    one, two = servers
    expected = completion(one, max_tokens=12, temperature=0)["choices"][0]["text"]
    operations = [
        ("/v1/bootstrap/swap", {"model": str(llama), "served_model_name": "m", **_config()}),
        ("/v1/bootstrap/weights", {"path": str(llama)}),
        ("/v1/bootstrap/sleep", {"level": 1}),
        ("/v1/bootstrap/wake", {}),
        ("/v1/bootstrap/sleep", {"level": 2}),
        ("/v1/bootstrap/wake", {}),
    ]
    for route, body in operations:
        answer = httpx.post(f"{two.url}{route}", json=body, timeout=120)
        assert answer.status_code == 200, (route, answer.text)
        if answer.json()["state"] == "ready":
            assert completion(two, max_tokens=12, temperature=0)["choices"][0]["text"] == expected, route


def test_a_sleep_while_a_stream_is_in_flight_drains_it_on_both_ranks_and_the_wake_answers_the_same(servers):
    """The sleep drains the stream (60 tiny tokens, far inside the 30 s drain timeout: it
    completes, none cut short), then releases both ranks' weights (level 2); the wake reads them
    again on both, and the same greedy text comes back."""
    one, two = servers
    greedy = {"max_tokens": 60, "temperature": 0, "ignore_eos": True}
    expected = completion(one, **greedy)["choices"][0]["text"]
    body = {"model": "m", "prompt": PROMPT, "stream": True, **greedy}
    slept: list[httpx.Response] = []
    with httpx.stream("POST", f"{two.url}/v1/completions", json=body, timeout=120) as response:
        lines = (line for line in response.iter_lines() if line)
        first = next(lines)  # mid-stream: its first token sent
        sleeper = threading.Thread(
            target=lambda: slept.append(httpx.post(f"{two.url}/v1/bootstrap/sleep", json={"level": 2}, timeout=120))
        )
        sleeper.start()
        rest = list(lines)
    sleeper.join(120)
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    reasons = [
        c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]
    ]
    assert rest[-1] == "data: [DONE]" and (text, reasons) == (expected, ["length"]), rest[-3:]
    assert len(slept) == 1 and slept[0].status_code == 200, slept
    assert (slept[0].json()["state"], slept[0].json()["cut_short"]) == ("asleep", 0)
    assert httpx.get(f"{two.url}/is_sleeping").json() == {"is_sleeping": True}
    woken = httpx.post(f"{two.url}/v1/bootstrap/wake", json={}, timeout=120)
    assert woken.status_code == 200 and woken.json()["state"] == "ready", woken.text
    assert completion(two, **greedy)["choices"][0]["text"] == expected
    engine = httpx.get(f"{two.url}/v1/engine").json()["engine"]
    assert engine["running"] == engine["waiting"] == engine["kv_used_blocks"] == 0


def _config() -> dict:
    return {"max_num_tokens": 64, "max_batch_size": 4, "max_seq_len": 512}


def test_sigterm_mid_stream_drains_and_stops_every_rank_with_status_0(llama, tmp_path):
    with serving(tmp_path, llama, "--trace-file", str(tmp_path / "trace.jsonl")) as server:
        sigterm_mid_stream(server, llama, tmp_path)


def sigterm_mid_stream(server: ServeProcess, llama: Path, tmp_path: Path) -> None:
    ranks = rank_pids(server.proc)
    assert len(ranks) == 2
    assert httpx.get(f"{server.url}/ready").json()["ranks"] == 2
    stages = httpx.get(f"{server.url}/v1/bootstrap").json()["stages"]
    profiling = next(s for s in stages if s["id"] == "profiling")  # every rank's seconds, by rank
    assert len(profiling["figures"]["bootstrap.collective.rank_seconds"].split()) == 2
    body = {"model": str(llama), "prompt": PROMPT, "max_tokens": 60, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # mid-stream
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(rest).replace(" ", "")
    assert server.proc.wait(EXIT_BOUND_S) == 0
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    assert "Traceback" not in server.log()
    for name in ("trace.jsonl", "trace.rank1.jsonl"):  # each rank's stages in its own file
        spans = [json.loads(line)["name"] for line in (tmp_path / name).read_text().splitlines()]
        assert "bootstrap.stage.profiling" in spans, name


def test_a_rank_killed_mid_stream_ends_the_server_with_a_line_naming_it(llama, tmp_path):
    with serving(tmp_path, llama) as server:
        rank_killed_mid_stream(server, llama)


def rank_killed_mid_stream(server: ServeProcess, llama: Path) -> None:
    ranks = rank_pids(server.proc)
    body = {"model": str(llama), "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        began = time.monotonic()
        subprocess.run(["kill", "-KILL", str(ranks[1])], check=True)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"code": "engine_error"' in "".join(rest)
    assert server.proc.wait(EXIT_BOUND_S) == 1
    assert time.monotonic() - began < 20  # not the launcher's 30 s wait: rank 0 ends by itself
    log = server.log()
    assert "bootstrap: rank 1 was killed by SIGKILL; the launcher stopped the other ranks" in log
    assert "the ranks fell out of step" in log
    assert not Path(f"/proc/{ranks[0]}").exists()


def test_two_torchrun_agents_with_nnodes_2_serve_as_one_launcher(llama, servers, tmp_path):
    one, _ = servers
    expected = completion(one, max_tokens=12, temperature=0)["choices"][0]["text"]
    port = _free_port()
    rdzv = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    rdzv += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "serve-tp"]
    command = ["-m", "bootstrap", "serve", "--model", str(llama), "--tp", "2", "--device", "cpu", *ARGS]
    command += ["--port", str(port), "--served-model-name", "m"]
    agents, logs = [], []
    for node in range(2):
        logs.append((tmp_path / f"agent{node}.log").open("w"))
        agents.append(
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *rdzv, *command],
                cwd=ROOT,
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
                env={**_env(), "PYTHONPATH": str(ROOT)},
            )
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        answer = httpx.post(
            f"{url}/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        )
        assert answer.json()["choices"][0]["text"] == expected
        texts = [(tmp_path / f"agent{n}.log").read_text() for n in range(2)]
        serving_node = next(n for n in range(2) if "Uvicorn running" in texts[n])
        agents[1 - serving_node].send_signal(signal.SIGTERM)  # the other host's agent: rank 0 must hear of it
        log = tmp_path / f"agent{serving_node}.log"
        deadline = time.monotonic() + EXIT_BOUND_S
        while "bootstrap serve: stopped; no thread left" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "rank 1 heard a stop signal: shutting down" in log.read_text()
        agents[1 - serving_node].wait(EXIT_BOUND_S)  # the agent signalled ends (status 1, whatever its rank did)
        # The serving agent, its rank ended, waits for the other at torchrun's exit barrier: a C++ store
        # wait that defers a signal up to the barrier's 300 s, so its own end is not awaited here; its
        # rank's is.
        agents[serving_node].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + EXIT_BOUND_S
        while children(agents[serving_node]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children(agents[serving_node]) == []
    finally:
        for agent, log in zip(agents, logs):
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            log.close()
    texts = [(tmp_path / f"agent{n}.log").read_text() for n in range(2)]
    assert sorted(text.count("Uvicorn running") for text in texts) == [0, 1]  # one rank opened the port
    assert sum("bootstrap serve: stopped; no thread left" in text for text in texts) == 1
    assert not any("out of step" in text or "stopped answering" in text for text in texts)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_the_status_page_shows_each_rank_s_seconds_of_a_stage(servers):
    from helpers.browser import chromium, console_errors, wait_for

    _, two = servers
    with chromium() as browser:
        browser.get(f"{two.url}/")
        note = "return document.querySelector('li[data-stage=\"profiling\"] .note')?.textContent"
        shown = wait_for(browser, lambda b: (b.execute_script(note) or "").startswith("ranks "), "the ranks' seconds")
        assert shown and len(browser.execute_script(note).split(" / ")) == 2  # "ranks 0.051 / 0.049 s"
        assert console_errors(browser) == []


def test_torchrun_without_tp_refuses_serve_once_before_any_port(llama):
    """Every rank finds the bad input; rank 0 says it, the other waits for the launcher to stop it."""
    rdzv = ["--nproc-per-node", "2", "--master-port", str(_free_port())]
    serve = ["-m", "bootstrap", "serve", "--model", str(llama), "--device", "cpu", "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *rdzv, *serve],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**_env(), "PYTHONPATH": str(ROOT)},
    )
    ours = [line for line in done.stderr.splitlines() if line.startswith("bootstrap: ")]
    assert ours == ["bootstrap: tensor_parallel_size: 1, but the launcher started 2 ranks (WORLD_SIZE 2); pass --tp 2"]
    assert "Uvicorn" not in done.stderr and done.returncode != 0  # torchrun's own status for failed ranks
