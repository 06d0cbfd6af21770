"""Markup in every field the status page shows is shown as text, never made into elements: the
served model name and a stage's failure (its event, the failure paragraph) sent through a real
server, then the page's own renderers given markup in every other field (stage rows, plan
figures, engine figures, request rows), in a real headless Chromium."""

from __future__ import annotations

import json

import pytest
from helpers.browser import chromium, console_errors, wait_for
from helpers.serve_backends import plugin_module
from helpers.serve_process import ServeProcess
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint

MARK = '<img src=x onerror="window.pwned=1"><b class="mark">bold</b>'
ELEMENTS = "return document.querySelectorAll('img, b.mark').length + (window.pwned ? 100 : 0)"
PLAN_FIELDS = (
    "kv_tokens kv_blocks tokens_per_block max_seq_len kv_requests max_batch_size max_concurrent_requests limited_by"
)
# every other field, through the page's own renderers, in one script (the page's polling cannot interleave);
# the KV block counts stay numbers: they set a <meter>
RENDER = """
const mark = arguments[0], plan = {};
for (const field of arguments[1].split(" ")) plan[field] = mark;
onStage({stage: mark, kind: "skipped", message: mark, at: page.t0 || 0, attempt: 1});
const stages = [{id: mark, state: "skipped", skip_reason: mark, attempts: 2, duration_s: null}];
showView({...page.view, state: "failed", model: mark, error: mark, current_stage: mark, plan: plan, stages: stages});
showEngine({engine: {kv_total_blocks: 8, kv_used_blocks: 1, running: mark, waiting: mark}, in_flight: mark,
            tokens_generated: mark, requests_answered: mark, server_time: 1, slowest: [{request_id: mark,
            endpoint: mark, total_s: 1, queue_s: 0, prefill_s: 0, decode_s: 0, prompt_tokens: mark,
            output_tokens: mark, finish_reason: mark}]});
const text = (selector) => document.querySelector(selector).textContent;
return {elements: document.querySelectorAll("img, b.mark").length, pwned: window.pwned === 1,
        fields: [text("#model"), text("#failed-stage"), text("#failure-text"), text("#plan-figures"),
                 text("#engine-figures"), text("#slowest tbody"), text("#event-list"),
                 text('li[data-stage="' + CSS.escape(mark) + '"] .name'),
                 text('li[data-stage="' + CSS.escape(mark) + '"] .note')]};
"""


@pytest.fixture
def failing_server(tmp_path):
    """A server named ``MARK`` whose final_build fails with ``MARK`` as its error."""
    checkpoint = save_checkpoint("llama", tmp_path / "llama", CHAT_TEMPLATE)
    backend = plugin_module(tmp_path, fail_once=("build_final",), failure=MARK)
    argv = ("--model", str(checkpoint), "--no-plan-cache", "--backend-factory", backend, "--served-model-name", MARK)
    server = ServeProcess(tmp_path / "serve.log", *argv, pythonpath=(tmp_path,))
    yield server
    server.stop()


def test_markup_in_every_field_the_status_page_shows_is_text(failing_server):
    with chromium() as browser:
        browser.get(failing_server.url + "/")
        wait_for(browser, lambda b: b.execute_script("return page.phase") == "failed", "the failure")
        shown = browser.execute_script(
            "return [$('model').textContent, $('failure-text').textContent, $('event-list').textContent]"
        )
        assert (
            shown[0] == MARK and MARK in shown[1] and f"final_build attempt 1 failed: RuntimeError: {MARK}" in shown[2]
        )
        assert browser.execute_script(ELEMENTS) == 0
        rendered = browser.execute_script(RENDER, MARK, PLAN_FIELDS)
        assert rendered["elements"] == 0 and not rendered["pwned"], rendered
        assert all(MARK in field for field in rendered["fields"]), json.dumps(rendered["fields"], indent=1)
        assert rendered["fields"][0] == MARK and rendered["fields"][3].count(MARK) == len(PLAN_FIELDS.split())
        assert console_errors(browser) == []
