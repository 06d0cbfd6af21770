"""The sampling extensions through a real server and the official ``openai`` client (issue 21):
``presence_penalty`` and ``frequency_penalty`` (OpenAI's own fields), and vLLM's ``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos`` and ``min_tokens`` (sent as
``extra_body``, as clients written for vLLM do). Each reaches the engine's sampler; each range is
a 400 in OpenAI's shape naming the field."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from helpers.serve_process import ServeProcess
from helpers.tiny_models import save_checkpoint

PROMPT = "w5 w37 w33 w9 w64 w42 w7"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    server = ServeProcess(tmp / "serve.log", "--model", str(checkpoint), "--no-plan-cache")
    server.wait_state("ready")
    yield server
    server.stop()


def complete(server: ServeProcess, checkpoint: Path, **fields) -> openai.types.CompletionChoice:
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    extra = {
        k: fields.pop(k)
        for k in list(fields)
        if k not in ("temperature", "seed", "max_tokens", "presence_penalty", "frequency_penalty", "stop")
    }
    return api.completions.create(
        model=str(checkpoint), prompt=PROMPT, **{"max_tokens": 12, **fields}, extra_body=extra or None
    ).choices[0]


def test_top_k_1_and_min_p_1_sample_the_greedy_answer(served, checkpoint):
    greedy = complete(served, checkpoint, temperature=0).text
    for seed in (1, 2, 3):
        assert complete(served, checkpoint, temperature=1.5, seed=seed, top_k=1).text == greedy
        assert complete(served, checkpoint, temperature=1.5, seed=seed, min_p=1.0).text == greedy
    assert {complete(served, checkpoint, temperature=1.5, seed=s).text for s in (1, 2, 3)} != {greedy}  # it does sample


def test_penalties_change_the_greedy_answer_and_repeat(served, checkpoint):
    greedy = complete(served, checkpoint, temperature=0, max_tokens=24)
    for field, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 1.8)):
        penalised = complete(served, checkpoint, temperature=0, max_tokens=24, **{field: value})
        again = complete(served, checkpoint, temperature=0, max_tokens=24, **{field: value})
        assert penalised.text == again.text, field
        assert penalised.text != greedy.text, field  # a penalty at its strongest changes what greedy picks
        words = penalised.text.split()
        if field == "presence_penalty":
            assert len(set(words)) >= len(set(greedy.text.split())), field


def test_stop_token_ids_end_the_answer_and_min_tokens_holds_them_back(served, checkpoint):
    api = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    logged = api.completions.create(model=str(checkpoint), prompt=PROMPT, max_tokens=12, temperature=0)
    words = logged.choices[0].text.split()
    first_new = next((i for i in range(1, len(words)) if words[i] not in words[:i]), 0)  # its first occurrence
    stop_id = int(words[first_new].removeprefix("w"))  # the tiny tokenizer's words are w<id>
    cut = complete(served, checkpoint, temperature=0, stop_token_ids=[stop_id])
    # the stop token is the last one, and its text is kept (as vLLM keeps a non-special one's)
    assert cut.finish_reason == "stop" and cut.text.split() == words[: first_new + 1]
    held = complete(served, checkpoint, temperature=0, stop_token_ids=[stop_id], min_tokens=12)
    assert held.finish_reason == "length" and stop_id not in [int(w[1:]) for w in held.text.split()][:12]
    assert complete(served, checkpoint, temperature=0, ignore_eos=True, max_tokens=12).finish_reason == "length"


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("top_k", -2, "greater than or equal to -1"),
        ("min_p", 1.5, "less than or equal to 1"),
        ("repetition_penalty", 0, "greater than 0"),
        ("presence_penalty", 2.5, "less than or equal to 2"),
        ("frequency_penalty", -3, "greater than or equal to -2"),
        ("min_tokens", -1, "greater than or equal to 0"),
        ("min_tokens", 13, "min_tokens"),  # more than max_tokens: the engine's own check
        ("stop_token_ids", [-1], "greater than or equal to 0"),
        ("ignore_eos", 2, "valid boolean"),
    ],
)
def test_each_range_is_a_400_naming_the_field(served, checkpoint, field, value, words):
    body = {"model": str(checkpoint), "prompt": PROMPT, "max_tokens": 12, field: value}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is not None and error["param"].startswith(field), error
    assert words in error["message"], error
