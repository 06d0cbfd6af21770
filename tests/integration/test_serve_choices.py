"""Several choices in one request through a real server (issue 21): completions with a list of
prompts (texts or token-id lists), each its own choice in prompt order, whole and streamed; ``n``
choices of a prompt (greedy: identical; seeded: the same on a second run), the prompt counted
once; refusals before anything runs; and a client that hangs up mid-stream cancels every choice."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers.serve_backends import plugin_module
from helpers.serve_process import ServeProcess, metric, metric_or_0, wait_metric

PROMPTS = ["w5 w37 w33 w9", "w64 w42 w7", "w11 w12 w13 w14 w15"]


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    server = ServeProcess(
        tmp_path_factory.mktemp("served") / "serve.log", "--model", str(checkpoint), "--no-plan-cache"
    )
    server.wait_state("ready")
    yield server
    server.stop()


def api(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def one_by_one(server, checkpoint, prompts) -> list[openai.types.Completion]:
    return [
        api(server).completions.create(model=str(checkpoint), prompt=p, max_tokens=8, temperature=0) for p in prompts
    ]


def test_a_list_of_prompts_is_a_choice_per_prompt_in_order(served, checkpoint):
    alone = one_by_one(served, checkpoint, PROMPTS)
    together = api(served).completions.create(model=str(checkpoint), prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert [c.finish_reason for c in together.choices] == [a.choices[0].finish_reason for a in alone]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_a_list_of_token_id_prompts_streamed_merges_every_choice(served, checkpoint):
    id_prompts = [[5, 37, 33, 9], [64, 42, 7]]
    alone = one_by_one(served, checkpoint, id_prompts)
    texts, finishes, usage = {}, {}, None
    stream = api(served).completions.create(
        model=str(checkpoint),
        prompt=id_prompts,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in finishes  # one finish per choice
                finishes[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert texts == {i: a.choices[0].text for i, a in enumerate(alone)}
    assert finishes == {i: a.choices[0].finish_reason for i, a in enumerate(alone)}
    assert usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


@pytest.mark.parametrize(
    "prompt, param, words",
    [
        (["w5"] * 65, "prompt", "65 prompts sent; at most 64"),
        ([], "prompt", "an empty list"),
        (["w5", "too long"], "max_tokens", "prompt[1]: prompt (512 tokens) + max_tokens (4) = 516 exceeds max_seq_len"),
    ],
)
def test_a_bad_prompt_list_is_refused_before_any_choice_runs(served, checkpoint, prompt, param, words):
    if "too long" in prompt:  # as many words as the served context holds: no room for max_tokens
        prompt = [prompt[0], "w6 " * httpx.get(f"{served.url}/v1/models").json()["data"][0]["max_model_len"]]
    before = httpx.get(f"{served.url}/metrics").text
    answer = httpx.post(
        f"{served.url}/v1/completions", json={"model": str(checkpoint), "prompt": prompt, "max_tokens": 4}
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert metric(httpx.get(f"{served.url}/metrics").text, "bootstrap_prompt_tokens_total") == metric(
        before, "bootstrap_prompt_tokens_total"
    )  # nothing was enqueued


@pytest.fixture(scope="module")
def slow_server(checkpoint, tmp_path_factory):
    """Every forward step sleeps 100 ms: the choices stay in flight for seconds."""
    tmp = tmp_path_factory.mktemp("slow")
    server = ServeProcess(
        tmp / "serve.log",
        "--model",
        str(checkpoint),
        "--no-plan-cache",
        "--backend-factory",
        plugin_module(tmp, step_delay_s=0.1),
        pythonpath=(tmp,),
    )
    server.wait_state("ready")
    yield server
    server.stop()


def test_hanging_up_mid_stream_cancels_every_choice(slow_server, checkpoint):
    body = {"model": str(checkpoint), "prompt": PROMPTS, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{slow_server.url}/v1/completions", json=body, timeout=60) as response:
        seen = set()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
            if seen == {0, 1, 2}:
                break  # every choice is generating; now hang up
    wait_metric(slow_server, "bootstrap_requests_total", 3, endpoint="completion", finish_reason="abort")
    wait_metric(slow_server, "bootstrap_kv_blocks_used", 0, timeout=5.0)
    wait_metric(slow_server, "bootstrap_requests_in_flight", 0, timeout=5.0)


def test_n_greedy_choices_are_identical_and_the_prompt_is_counted_once(served, checkpoint):
    [alone] = one_by_one(served, checkpoint, PROMPTS[:1])
    four = api(served).completions.create(model=str(checkpoint), prompt=PROMPTS[0], max_tokens=8, temperature=0, n=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert {c.text for c in four.choices} == {alone.choices[0].text}
    assert four.usage.prompt_tokens == alone.usage.prompt_tokens  # prefilled once, counted once
    assert four.usage.completion_tokens == 4 * alone.usage.completion_tokens


def test_n_choices_count_each_prompt_once_in_the_metrics_as_in_usage(served, checkpoint):
    before = metric_or_0(httpx.get(f"{served.url}/metrics").text, "bootstrap_prompt_tokens_total")
    six = api(served).completions.create(model=str(checkpoint), prompt=PROMPTS[:2], max_tokens=4, n=3)
    after = metric(httpx.get(f"{served.url}/metrics").text, "bootstrap_prompt_tokens_total")
    assert after - before == six.usage.prompt_tokens == 7  # 4 + 3 words, each prompt once


def test_n_seeded_chat_choices_repeat_on_a_second_run_streamed_or_not(served, checkpoint):
    create = {
        "model": str(checkpoint),
        "messages": [{"role": "user", "content": "w9 w64 w42"}],
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 1234,
        "n": 4,
    }
    whole = [c.message.content for c in api(served).chat.completions.create(**create).choices]
    again = [c.message.content for c in api(served).chat.completions.create(**create).choices]
    streamed: dict[int, str] = {}
    for chunk in api(served).chat.completions.create(**create, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert whole == again == [streamed[i] for i in range(4)] and len(set(whole)) > 1  # each choice its own draw


def test_n_choices_of_a_prompt_list_are_numbered_prompt_by_prompt(served, checkpoint):
    alone = one_by_one(served, checkpoint, PROMPTS[:2])
    both = api(served).completions.create(model=str(checkpoint), prompt=PROMPTS[:2], max_tokens=8, temperature=0, n=3)
    assert [c.index for c in both.choices] == list(range(6))
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(3)]
