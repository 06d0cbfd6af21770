"""The status page (``GET /``) in a real headless Chromium, watching a real bootstrap of a tiny
checkpoint behind an API key: every stage goes from pending to running to done on the page as
it happens (the first one held at a gate while the page watches), a stage made to fail shows
its error and paragraph, the retry button brings it to done, the engine's load and the slowest
requests appear once it serves, it fits a phone's width, and the console stays free of errors.
Screenshots go to ``--screenshots DIR`` (``docs/`` holds the committed ones)."""

from __future__ import annotations

import os

import httpx
import pytest
from helpers.browser import chromium, console_errors, wait_for
from helpers.serve_backends import open_gate, plugin_module
from helpers.serve_process import ServeProcess
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint

from bootstrap.stages import STAGE_IDS

KEY = "page-key-0123"
SKIPPED_ON_CPU = ("warmup",)  # CUDA graphs: nothing to capture on a CPU


def seen(browser) -> dict[str, str]:
    """Each stage row's states in the order the page showed them."""
    return browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('li[data-stage]')]"
        ".map(li => [li.dataset.stage, li.dataset.seen]))"
    )


def state_of(browser, stage: str) -> str | None:
    return browser.execute_script(f"return document.querySelector('li[data-stage=\"{stage}\"]')?.dataset.state")


def text(browser, element_id: str) -> str:
    return browser.execute_script(f"return document.getElementById('{element_id}').textContent")


def visible(browser, element_id: str) -> bool:
    return browser.execute_script(f"return !document.getElementById('{element_id}').hidden")


@pytest.fixture
def held_server(tmp_path):
    """A server whose load_model waits at a gate and whose final_build fails once."""
    checkpoint = save_checkpoint("llama", tmp_path / "llama", CHAT_TEMPLATE)
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
        "--api-key",
        KEY,
        "--served-model-name",
        "tiny-llama",
        pythonpath=(tmp_path,),
    )
    yield server, gate, checkpoint
    server.stop()


def test_the_page_follows_a_bootstrap_through_a_failure_and_a_retry_to_serving(held_server, screenshots):
    server, gate, _ = held_server
    with chromium() as browser:
        browser.get(server.url.replace("http://", f"http://user:{KEY}@") + "/")  # the key as Basic credentials
        wait_for(browser, lambda b: state_of(b, "load_model") == "running", "load_model running")
        clock = text(browser, "clock")
        assert (
            state_of(browser, "resolve_classes") == "done"
            and seen(browser)["resolve_classes"] == "pending running done"
        )
        assert all(seen(browser)[stage] == "pending" for stage in STAGE_IDS[2:])
        wait_for(browser, lambda b: "started" in text(b, "clock") and text(b, "clock") != clock, "the clock ticking")
        browser.save_screenshot(str(screenshots / "status-page-bootstrapping.png"))

        open_gate(gate)
        wait_for(browser, lambda b: text(b, "phase") == "failed" and visible(b, "retry"), "the failure")
        assert text(browser, "failed-stage") == "final_build" and state_of(browser, "final_build") == "failed"
        assert "injected failure in build_final" in text(browser, "failure-text")
        assert "final_build attempt 1 failed: RuntimeError: injected failure" in text(browser, "event-list")
        assert [state_of(browser, s) for s in ("warmup", "scheduler_sampler")] == ["pending", "pending"]
        browser.save_screenshot(str(screenshots / "status-page-failed.png"))

        browser.find_element("id", "retry").click()
        wait_for(browser, lambda b: text(b, "phase") == "ready" and visible(b, "serving"), "ready and serving")
        history = seen(browser)
        assert history["final_build"] == "pending running failed running done"  # resumed there: the rest kept
        assert history["load_model"] == "pending running done"  # the weights were not loaded again
        for stage in STAGE_IDS:
            done = "pending running skipped" if stage in SKIPPED_ON_CPU else "pending running done"
            assert history[stage] in (done, "pending running failed running done"), stage
        assert not visible(browser, "failure")

        auth = {"Authorization": f"Bearer {KEY}"}
        for tokens in (2, 9, 5):
            reply = httpx.post(
                f"{server.url}/v1/completions",
                headers=auth,
                timeout=60,
                json={"model": "tiny-llama", "prompt": "w5 w6 w7", "max_tokens": tokens, "temperature": 0},
            )
            assert reply.status_code == 200
        rows = wait_for(
            browser,
            lambda b: (
                b.find_elements("css selector", "#slowest tbody tr")
                if visible(b, "slowest") and len(b.find_elements("css selector", "#slowest tbody tr")) == 3
                else None
            ),
            "three requests",
        )
        cells = [[td.text for td in row.find_elements("tag name", "td")] for row in rows]
        assert sorted(c[6] for c in cells) == ["3 → 2", "3 → 5", "3 → 9"]  # every request, its tokens
        totals = [float(c[2]) for c in cells]
        assert totals == sorted(totals, reverse=True)  # the slowest first (which one is, the machine decides)
        assert (
            text(browser, "model") == "tiny-llama"
            and "KV blocks in use" in text(browser, "engine-figures")
            and "KV budget" in text(browser, "plan-figures")
        )
        browser.save_screenshot(str(screenshots / "status-page-ready.png"))

        browser.set_window_size(390, 844)  # a phone
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
        browser.save_screenshot(str(screenshots / "status-page-phone.png"))
        assert console_errors(browser) == []


def test_the_page_asks_a_browser_for_the_key_and_runs_only_its_own_code(held_server):
    server, gate, _ = held_server
    open_gate(gate)
    asked = httpx.get(f"{server.url}/", headers={"Accept": "text/html"})
    assert asked.status_code == 401 and asked.headers["WWW-Authenticate"].startswith('Basic realm="executor-bootstrap"')
    api = httpx.get(f"{server.url}/v1/engine")
    assert api.status_code == 401 and api.headers["WWW-Authenticate"] == "Bearer"
    page = httpx.get(f"{server.url}/", auth=("anyone", KEY))
    policy = page.headers["Content-Security-Policy"]
    assert page.status_code == 200 and "<title>executor-bootstrap</title>" in page.text
    assert "connect-src 'self'" in policy and "'unsafe-inline'" not in policy and "script-src 'sha256-" in policy
    assert "http://" not in page.text and "https://" not in page.text  # nothing is fetched from elsewhere
    server.wait_state("failed")
    forged = httpx.post(
        f"{server.url}/v1/bootstrap/retry", auth=("anyone", KEY), headers={"Origin": "http://evil.example"}
    )
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "cross_site"
    assert httpx.get(f"{server.url}/ready").json()["state"] == "failed"  # the forged retry changed nothing
