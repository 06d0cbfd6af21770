"""Logprobs through a real server and the official ``openai`` client (issue 21), in OpenAI's two
shapes, streamed and not: chat's ``choices[].logprobs.content[]`` and completions' ``tokens`` /
``token_logprobs`` / ``top_logprobs`` / ``text_offset``. The numbers are the model's own: equal,
within 1e-4, to log-softmax of a transformers model's logits for the same prefix."""

from __future__ import annotations

import openai
import pytest
import torch
from helpers.serve_process import ServeProcess
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT_IDS = [1, 17, 40, 99, 7]
MESSAGES = [{"role": "user", "content": "w9 w64 w42"}]


@pytest.fixture(scope="module")
def api(checkpoint, tmp_path_factory):
    server = ServeProcess(
        tmp_path_factory.mktemp("served") / "serve.log", "--model", str(checkpoint), "--no-plan-cache"
    )
    server.wait_state("ready")
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    server.stop()


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()

    def logprobs_after(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)

    return logprobs_after


def word_id(token: str) -> int:
    return int(token.strip().removeprefix("w"))  # the tiny tokenizer's token i is the word w<i>


def completion(api, checkpoint, stream: bool, **fields):
    create = {
        "model": str(checkpoint),
        "prompt": PROMPT_IDS,
        "max_tokens": 6,
        "temperature": 0,
        "stream": stream,
        "extra_body": {"ignore_eos": True},
        **fields,
    }
    if not stream:
        choice = api.completions.create(**create).choices[0]
        return choice.text, choice.logprobs
    text, tokens, token_logprobs, top, offsets = "", [], [], [], []
    for chunk in api.completions.create(**create):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                token_logprobs += choice.logprobs.token_logprobs
                top += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    return text, openai.types.completion_choice.Logprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_are_the_models_own(api, checkpoint, reference, stream):
    text, lp = completion(api, checkpoint, stream, logprobs=5)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    # each offset is where the token's text starts (this tokenizer puts a space before each word)
    assert all(text[o:].lstrip().startswith(t) for o, t in zip(lp.text_offset, lp.tokens)), (text, lp)
    assert lp.text_offset[0] == 0 and all(a < b for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    ids = [word_id(t) for t in lp.tokens]
    for step, (token, logprob, top) in enumerate(zip(ids, lp.token_logprobs, lp.top_logprobs)):
        want = reference(PROMPT_IDS + ids[:step])
        values, top_ids = want.topk(5)
        assert token == int(top_ids[0])  # greedy: the chosen token is the most likely
        assert logprob == pytest.approx(float(want[token]), abs=1e-4)
        assert {word_id(t): v for t, v in top.items()} == pytest.approx(
            dict(zip(top_ids.tolist(), values.tolist())), abs=1e-4
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_text_offset_does_not_move_with_a_stop_string_never_produced(api, checkpoint, stream):
    text, lp = completion(api, checkpoint, stream, logprobs=1)
    held_text, held = completion(api, checkpoint, stream, logprobs=1, stop=["never said"])  # text held back
    assert (held_text, held.tokens) == (text, lp.tokens)
    assert held.text_offset == lp.text_offset and lp.text_offset[0] == 0
    assert all(text[o:].lstrip().startswith(t) for o, t in zip(held.text_offset, held.tokens)), (text, held)


def test_completion_logprobs_name_the_sampled_token_even_outside_the_top(api, checkpoint):
    _, lp = completion(api, checkpoint, False, logprobs=0, temperature=2.0, seed=7, max_tokens=12)
    assert all(
        list(top) == [token] and top[token] == logprob
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
    )


def chat(api, checkpoint, stream: bool, **fields):
    create = {
        "model": str(checkpoint),
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "stream": stream,
        "extra_body": {"ignore_eos": True},
        **fields,
    }
    if not stream:
        choice = api.chat.completions.create(**create).choices[0]
        return choice.message.content, choice.logprobs
    content, entries = "", []
    for chunk in api.chat.completions.create(**create):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            entries += choice.logprobs.content if choice.logprobs is not None else []
    return content, openai.types.chat.chat_completion.ChoiceLogprobs(content=entries)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_in_openais_shape(api, checkpoint, reference, stream):
    content, lp = chat(api, checkpoint, stream, logprobs=True, top_logprobs=3)
    # every token has its entry; EOS (w2, generated under ignore_eos) has no text in the content
    assert len(lp.content) == 6 and " ".join(e.token for e in lp.content if e.token != "w2") == content.strip()
    prompt = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = [word_id(e.token) for e in lp.content]
    for step, entry in enumerate(lp.content):
        want = reference(list(prompt) + ids[:step])
        assert entry.bytes == list(entry.token.encode()) and entry.logprob == pytest.approx(
            float(want[ids[step]]), abs=1e-4
        )
        assert [word_id(t.token) for t in entry.top_logprobs] == want.topk(3).indices.tolist()
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    assert content == chat(api, checkpoint, not stream, logprobs=True, top_logprobs=3)[0]  # the other way: same text


def test_logprobs_without_top_logprobs_and_not_asked(api, checkpoint):
    _, lp = chat(api, checkpoint, False, logprobs=True)
    assert len(lp.content) == 6 and all(e.top_logprobs == [] for e in lp.content)
    assert chat(api, checkpoint, False)[1] is None and completion(api, checkpoint, False)[1] is None


@pytest.mark.parametrize(
    "endpoint, fields, param, words",
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ("chat", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ("completion", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ("completion", {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ],
)
def test_each_logprobs_range_is_a_400_naming_the_field(api, checkpoint, endpoint, fields, param, words):
    with pytest.raises(openai.BadRequestError) as refused:
        (chat if endpoint == "chat" else completion)(api, checkpoint, False, **fields)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error
