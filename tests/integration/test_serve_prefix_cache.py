"""Prefix caching through the real server (``bootstrap serve`` in a subprocess, a tiny checkpoint
with a chat template, the official ``openai`` client): ``usage.prompt_tokens_details.cached_tokens``
for completions and chat, whole and streamed, counted once for ``n`` choices; ``cache_salt``
keeping requests of different salts apart, and refused when malformed; ``--no-prefix-cache``;
the figures of ``/v1/engine``, ``/metrics``, the plan, the request span, and the status page
in a real headless Chromium.

The requests of a test share a prefix no other test sends (``words``), so each test starts from
its own cold cache whatever ran before it on the same server.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers.browser import chromium, console_errors, wait_for
from helpers.serve_process import ServeProcess, metric

from bootstrap.serve.request_trace import CACHED_TOKENS

TOKENS_PER_BLOCK = 32  # the config's default
SHARED = 80  # words the requests of a test share: two full blocks, and part of a third
HIT = SHARED // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK  # what a later request finds cached: the full blocks
MARK = '<img src=x onerror="window.pwned=1"><b class="mark">bold</b>'


WORDS = [*range(3, 10), *range(30, 100)]  # one token each: a word starting w0, w1 or w2 splits around the special one


def words(seed: int, count: int = SHARED) -> str:
    """``count`` seeded words of the tiny tokenizer."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.choice(WORDS)}" for _ in range(count))


def start(tmp: Path, checkpoint: Path, *flags: str) -> ServeProcess:
    server = ServeProcess(tmp / "serve.log", "--model", str(checkpoint), "--no-plan-cache", *flags)
    server.wait_state("ready")
    return server


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """A server with prefix caching (the default), tracing its requests to ``trace.jsonl``."""
    tmp = tmp_path_factory.mktemp("served")
    server = start(tmp, checkpoint, "--trace-file", str(tmp / "trace.jsonl"))
    server.trace = tmp / "trace.jsonl"
    yield server
    server.stop()


@pytest.fixture(scope="module")
def uncached(checkpoint, tmp_path_factory):
    server = start(tmp_path_factory.mktemp("uncached"), checkpoint, "--no-prefix-cache")
    yield server
    server.stop()


def api(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def complete(server: ServeProcess, checkpoint: Path, prompt: str | list[str], **extra) -> openai.types.Completion:
    return api(server).completions.create(model=str(checkpoint), prompt=prompt, max_tokens=4, temperature=0, **extra)


def chat(server: ServeProcess, checkpoint: Path, system: str, user: str, **extra):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return api(server).chat.completions.create(
        model=str(checkpoint), messages=messages, max_tokens=4, temperature=0, **extra
    )


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def streamed_usage(chunks) -> object:
    """The usage chunk of a stream read to its end: the last one, without choices."""
    chunks = list(chunks)
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return chunks[-1].usage


def engine(server: ServeProcess) -> dict:
    return httpx.get(f"{server.url}/v1/engine", timeout=10).json()["engine"]


# ---- cached_tokens through the openai client ------------------------------------------------------


def test_completions_count_the_cached_prefix_whole_and_streamed(served, checkpoint):
    prefix = words(1)
    first = complete(served, checkpoint, prefix + " w7 w8")
    assert first.usage.prompt_tokens == SHARED + 2 and cached(first.usage) == 0  # nothing of it computed before
    second = complete(served, checkpoint, prefix + " w9 w40 w41")
    assert cached(second.usage) == HIT and second.usage.prompt_tokens == SHARED + 3
    stream = complete(served, checkpoint, prefix + " w42", stream=True, stream_options={"include_usage": True})
    assert cached(streamed_usage(stream)) == HIT
    fresh = complete(served, checkpoint, words(101) + " w7 w8")  # no prefix in common
    assert cached(fresh.usage) == 0


def test_chat_counts_the_cached_prefix_whole_and_streamed(served, checkpoint):
    system = words(2)  # the template: w3 SYSTEM w4 USER w5
    first = chat(served, checkpoint, system, "w50 w51")
    assert first.usage.prompt_tokens == SHARED + 5 and cached(first.usage) == 0
    second = chat(served, checkpoint, system, "w52")
    assert cached(second.usage) == HIT
    stream = chat(served, checkpoint, system, "w53 w54", stream=True, stream_options={"include_usage": True})
    assert cached(streamed_usage(stream)) == HIT


def test_n_choices_and_prompt_lists_count_each_prompt_once(served, checkpoint):
    prefix = words(3)
    assert cached(complete(served, checkpoint, prefix + " w7").usage) == 0
    three = complete(served, checkpoint, prefix + " w8", n=3)
    assert len(three.choices) == 3 and three.usage.prompt_tokens == SHARED + 1
    assert cached(three.usage) == HIT  # the first choice's: the prompt is prefilled once
    both = complete(served, checkpoint, [prefix + " w9", prefix + " w40 w41"], n=2)
    assert len(both.choices) == 4 and cached(both.usage) == 2 * HIT  # each prompt once


# ---- cache_salt ------------------------------------------------------------------------------------


def test_a_request_shares_cached_blocks_only_with_requests_of_its_salt(served, checkpoint):
    prefix = words(4)
    salted = lambda salt: {"extra_body": {"cache_salt": salt}}  # noqa: E731
    assert cached(complete(served, checkpoint, prefix + " w7").usage) == 0
    assert cached(complete(served, checkpoint, prefix + " w8", **salted("tenant-a")).usage) == 0  # another salt
    assert cached(complete(served, checkpoint, prefix + " w9", **salted("tenant-a")).usage) == HIT
    assert cached(complete(served, checkpoint, prefix + " w9", **salted("tenant-b")).usage) == 0
    assert cached(complete(served, checkpoint, prefix + " w40").usage) == HIT  # no salt: its own, still cached
    system = words(5)
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    assert cached(chat(served, checkpoint, system, "w50", **salted("tenant-a")).usage) == 0
    assert cached(streamed_usage(chat(served, checkpoint, system, "w51", **streamed, **salted("tenant-a")))) == HIT
    assert cached(streamed_usage(chat(served, checkpoint, system, "w51", **streamed, **salted("tenant-c")))) == 0
    assert cached(chat(served, checkpoint, system, "w52").usage) == 0  # no salt differs from every salt


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", [7, "", "s" * 1025, ["tenant"], {"tenant": "a"}, True])
def test_a_malformed_cache_salt_is_a_400_naming_the_field(served, checkpoint, route, salt):
    body = {"model": str(checkpoint), "max_tokens": 2, "cache_salt": salt}
    body |= {"prompt": "w5 w6"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "w5"}]}
    reply = httpx.post(f"{served.url}{route}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("cache_salt: must be a string of 1 to 1024 characters, or left out")
    assert error["message"].count("cache_salt") == 1 and "\n" not in error["message"]  # one line, this field's


def test_the_openai_client_sees_the_400_and_the_bounds_are_taken(served, checkpoint):
    with pytest.raises(openai.BadRequestError) as refused:
        complete(served, checkpoint, "w5 w6", extra_body={"cache_salt": ""})
    assert refused.value.body["param"] == "cache_salt" and "1 to 1024 characters" in refused.value.body["message"]
    for salt in ("x", "é" * 1024, None):  # None: no salt, as JSON null says
        assert complete(served, checkpoint, "w5 w6", extra_body={"cache_salt": salt}).choices[0].finish_reason


# ---- figures ---------------------------------------------------------------------------------------


def test_engine_figures_and_metrics_follow_the_cache(served, checkpoint):
    before = engine(served)
    prefix = words(6)
    asked = [complete(served, checkpoint, prefix + suffix).usage.prompt_tokens for suffix in (" w7", " w8 w9")]
    after = engine(served)
    assert after["prefix_caching"] is True
    assert after["overlap"] is False  # on the CPU a step is done when launched: nothing to overlap
    assert after["prefix_query_tokens"] - before["prefix_query_tokens"] == sum(asked)
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == HIT
    assert after["prefix_hit_rate"] == after["prefix_hit_tokens"] / after["prefix_query_tokens"]
    assert after["kv_cached_blocks"] >= before["kv_cached_blocks"] + SHARED // TOKENS_PER_BLOCK
    assert after["kv_cached_free_blocks"] == after["kv_cached_blocks"] and after["kv_used_blocks"] == 0  # none held
    page = httpx.get(f"{served.url}/metrics", timeout=10).text
    assert metric(page, "bootstrap_prefix_caching") == 1
    assert metric(page, "bootstrap_kv_cached_blocks") == after["kv_cached_blocks"]
    assert metric(page, "bootstrap_kv_cached_free_blocks") == after["kv_cached_free_blocks"]
    assert metric(page, "bootstrap_prefix_cache_query_tokens_total") == after["prefix_query_tokens"]
    assert metric(page, "bootstrap_prefix_cache_hit_tokens_total") == after["prefix_hit_tokens"]
    assert "# TYPE bootstrap_prefix_cache_hit_tokens_total counter" in page
    assert httpx.get(f"{served.url}/v1/bootstrap", timeout=10).json()["plan"]["prefix_caching"] is True


def test_the_request_span_records_the_cached_tokens(served, checkpoint):
    prefix = words(7)
    complete(served, checkpoint, prefix + " w7")
    trace_id = f"{random.getrandbits(128):032x}"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    body = {"model": str(checkpoint), "prompt": prefix + " w8", "max_tokens": 3, "temperature": 0, "n": 2}
    reply = httpx.post(f"{served.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert cached_of(reply.json()["usage"]) == HIT
    spans = spans_of(served.trace, trace_id, 3)  # the request and its two choices' spans
    [request] = [s for s in spans if s["name"] == "bootstrap.request"]
    choices = sorted((s for s in spans if s["name"] == "bootstrap.request.choice"), key=choice_index)
    assert request["attributes"][CACHED_TOKENS] == HIT == cached_of(reply.json()["usage"])
    assert [c["attributes"][CACHED_TOKENS] for c in choices] == [HIT, 0]  # the second shares the first's prefill


def cached_of(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def choice_index(span: dict) -> int:
    return span["attributes"]["bootstrap.choice"]


def spans_of(path: Path, trace_id: str, count: int, timeout: float = 30.0) -> list[dict]:
    """The trace's spans once ``count`` of them are in the file (written in batches, off the loop)."""
    deadline, spans = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        spans = [json.loads(line) for line in path.read_text().splitlines() if trace_id in line]
        if sum(s["name"] in ("bootstrap.request", "bootstrap.request.choice") for s in spans) >= count:
            return spans
        time.sleep(0.05)
    raise TimeoutError(f"{count} spans of trace {trace_id} never reached {path}: {spans}")


# ---- --no-prefix-cache -----------------------------------------------------------------------------


def test_without_the_prefix_cache_nothing_is_cached(uncached, checkpoint):
    prefix = words(8)
    for suffix in (" w7", " w8", " w8"):
        assert cached(complete(uncached, checkpoint, prefix + suffix).usage) == 0
    stream = complete(uncached, checkpoint, prefix + " w8", stream=True, stream_options={"include_usage": True})
    assert cached(streamed_usage(stream)) == 0
    salted = complete(uncached, checkpoint, prefix + " w8", extra_body={"cache_salt": "tenant-a"})
    assert cached(salted.usage) == 0  # taken, and nothing to share
    assert cached(chat(uncached, checkpoint, prefix, "w9").usage) == 0
    figures = engine(uncached)
    assert figures["prefix_caching"] is False and figures["prefix_hit_rate"] is None
    assert figures["kv_cached_blocks"] == figures["prefix_query_tokens"] == figures["prefix_hit_tokens"] == 0
    page = httpx.get(f"{uncached.url}/metrics", timeout=10).text
    assert metric(page, "bootstrap_prefix_caching") == 0
    assert metric(page, "bootstrap_prefix_cache_hit_tokens_total") == metric(page, "bootstrap_kv_cached_blocks") == 0
    assert httpx.get(f"{uncached.url}/v1/bootstrap", timeout=10).json()["plan"]["prefix_caching"] is False


# ---- the status page -------------------------------------------------------------------------------

FIGURES = (
    "return Object.fromEntries([...document.querySelectorAll('#%s > div')]"
    ".map(d => [d.querySelector('dt').textContent, d.querySelector('dd').textContent]))"
)
RENDER = """
const mark = arguments[0];
showEngine({engine: {kv_total_blocks: 8, kv_used_blocks: 1, running: 0, waiting: 0, prefix_caching: true,
            kv_cached_blocks: mark, kv_cached_free_blocks: mark, prefix_query_tokens: mark,
            prefix_hit_tokens: mark, prefix_hit_rate: mark}, in_flight: 0, tokens_generated: 0,
            requests_answered: 0, server_time: 1, slowest: []});
return {elements: document.querySelectorAll("img, b.mark").length, pwned: window.pwned === 1,
        text: document.getElementById("engine-figures").textContent};
"""


def showing(browser, figure: str, value: str) -> dict[str, str] | None:
    """The engine's figures once ``figure`` reads ``value`` (the page refreshes them each second)."""
    shown = browser.execute_script(FIGURES % "engine-figures")
    return shown if shown.get(figure) == value else None


def test_the_status_page_shows_the_cached_blocks_and_the_hit_rate(served, uncached, checkpoint, screenshots):
    prefix = words(9)
    for suffix in (" w7", " w8", " w9 w40", " w41"):
        complete(served, checkpoint, prefix + suffix)
    figures = engine(served)  # nothing is sent from here on: the page's figures are these
    rate = f"{figures['prefix_hit_rate'] * 100:.1f} %"
    with chromium(1280, 1600) as browser:
        browser.get(served.url + "/")
        shown = wait_for(browser, lambda b: showing(b, "prefix hit rate", rate), f"the hit rate {rate}")
        assert shown["cached KV blocks"] == f"{figures['kv_cached_blocks']} ({figures['kv_cached_free_blocks']} free)"
        hits = f"{figures['prefix_hit_tokens']} / {figures['prefix_query_tokens']} tokens"
        assert shown["prefix cache hits"] == hits
        assert list(shown).index("cached KV blocks") == list(shown).index("KV blocks in use") + 1  # beside the KV
        assert browser.execute_script(FIGURES % "plan-figures")["prefix caching"] == "on"
        browser.save_screenshot(str(screenshots / "status-page-prefix-cache.png"))
        rendered = browser.execute_script(RENDER, MARK)  # what the page shows is text, never markup
        assert rendered["elements"] == 0 and not rendered["pwned"] and rendered["text"].count(MARK) == 4
        assert console_errors(browser) == []

        browser.get(uncached.url + "/")
        wait_for(browser, lambda b: showing(b, "prefix cache", "off"), "the prefix cache off")
        assert browser.execute_script(FIGURES % "plan-figures")["prefix caching"] == "off"
        assert console_errors(browser) == []
