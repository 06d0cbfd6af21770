"""Prefix caching at the server's edge, without a model: ``cache_salt`` checked as the engine
checks it (the same values taken and refused, one 400 line naming the field), ``usage`` in
OpenAI's shape with ``prompt_tokens_details.cached_tokens`` (read back by the ``openai``
package's own type), and ``bootstrap plan`` saying whether prefix caching is on."""

from __future__ import annotations

import json

import pytest
from openai.types import CompletionUsage

from bootstrap.cli.main import main
from bootstrap.engine.executor.py_executor import MAX_CACHE_SALT_CHARS, check_cache_salt
from bootstrap.serve.errors import APIError
from bootstrap.serve.openai import schemas as s
from bootstrap.serve.openai.bodies import validated

SALTS = [None, "a", "tenant-42", "é" * 1024, "x" * 1024, "", "x" * 1025, 7, 0, True, 1.5, ["a"], {"a": 1}]
BODIES = {
    s.CompletionRequest: {"model": "m", "prompt": "w5"},
    s.ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "w5"}]},
}


def engine_takes(salt: object) -> bool:
    try:
        check_cache_salt(salt)
    except (TypeError, ValueError):
        return False
    return True


def test_the_server_bound_is_the_engines():
    assert s.MAX_CACHE_SALT_CHARS == MAX_CACHE_SALT_CHARS


@pytest.mark.parametrize("model", list(BODIES))
@pytest.mark.parametrize("salt", SALTS, ids=repr)
def test_the_server_takes_and_refuses_the_salts_the_engine_does(model, salt):
    raw = json.dumps({**BODIES[model], "cache_salt": salt}).encode()
    if engine_takes(salt):
        assert validated(raw, model).cache_salt == salt
        return
    with pytest.raises(APIError) as refused:
        validated(raw, model)
    error = refused.value
    assert error.status == 400 and error.param == "cache_salt"
    assert error.message.startswith("cache_salt: must be a string of 1 to 1024 characters, or left out")
    assert error.message.count("cache_salt") == 1 and "\n" not in error.message
    if isinstance(salt, str):
        assert f"; {len(salt)} sent (got " in error.message


def test_a_salt_left_out_is_none():
    for model, body in BODIES.items():
        assert validated(json.dumps(body).encode(), model).cache_salt is None


def test_usage_carries_the_cached_tokens_in_openais_shape():
    usage = s.Usage.of(100, 7, cached=64)
    dumped = usage.model_dump()
    assert dumped == {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "total_tokens": 107,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    assert CompletionUsage.model_validate(dumped).prompt_tokens_details.cached_tokens == 64
    assert s.Usage.of(3, 1).prompt_tokens_details.cached_tokens == 0  # always present: 0 when nothing was cached


@pytest.mark.parametrize(("flags", "on"), [((), True), (("--no-prefix-cache",), False)])
def test_bootstrap_plan_says_whether_prefix_caching_is_on(capsys, flags, on):
    base = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", *flags]
    assert main([*base, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["prefix_caching"] is on
    assert main(base) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prefix caching:")]
    expected = "prefix caching: on (" if on else "prefix caching: off (--no-prefix-cache)"
    assert len(lines) == 1 and lines[0].startswith(expected)
