"""The status page (``GET /``) through a real server's live operations, in headless Chromium: a
swap held at its ``load_model`` shows the phase ``swapping`` and a running row in the history
of operations; then a weights update refused for a path of markup (shown as text),
a sleep (the released stages pending again, the phase ``asleep``) and a wake, each a row of
the history, newest first."""

from __future__ import annotations

import os
import shutil
import threading

import httpx
import pytest
from helpers.browser import chromium, console_errors, wait_for
from helpers.serve_backends import open_gate, plugin_module
from helpers.serve_process import ServeProcess
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint

MARK = '<img src=x onerror="window.pwned=1"> & <b class="mark">'  # a folder name: no slash
ELEMENTS = "return document.querySelectorAll('img, b.mark').length + (window.pwned ? 100 : 0)"
RELEASED = ("final_build", "warmup", "scheduler_sampler")  # a sleep's rewound stages


def history(browser) -> list[list[str]]:
    """The rows of the history of operations as shown: operation, detail, outcome, duration, error."""
    return browser.execute_script(
        "return [...document.querySelectorAll('#operation-list tbody tr')]"
        ".map(tr => [...tr.children].map(td => td.textContent))"
    )


def text(browser, element_id: str) -> str:
    return browser.execute_script(f"return document.getElementById('{element_id}').textContent")


def visible(browser, element_id: str) -> bool:
    return browser.execute_script(f"return !document.getElementById('{element_id}').hidden")


def state_of(browser, stage: str) -> str | None:
    return browser.execute_script(f"return document.querySelector('li[data-stage=\"{stage}\"]')?.dataset.state")


def shows(phase: str, first: tuple[str, str], rows: int):
    """The page's phase is ``phase`` and its history ``rows`` long, the newest (operation, outcome) ``first``."""

    def check(browser) -> bool:
        shown = history(browser)
        return text(browser, "phase") == phase and len(shown) == rows and (shown[0][0], shown[0][2]) == first

    return check


@pytest.fixture
def server(tmp_path):
    """A tiny llama served with ``load_model`` held at a gate each time it runs (the start, a swap)."""
    checkpoints = {
        "llama": save_checkpoint("llama", tmp_path / "llama", CHAT_TEMPLATE),
        "qwen": save_checkpoint("qwen2", tmp_path / "qwen2", CHAT_TEMPLATE),
    }
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    backend = plugin_module(tmp_path, gate=str(gate), gated="load_model")
    argv = ("--model", str(checkpoints["llama"]), "--no-plan-cache", "--backend-factory", backend)
    process = ServeProcess(tmp_path / "serve.log", *argv, "--served-model-name", "tiny", pythonpath=(tmp_path,))
    open_gate(gate)
    process.wait_state("ready")
    yield process, gate, checkpoints
    process.stop()


def post(server: ServeProcess, operation: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/bootstrap/{operation}", json=body, timeout=120)


def test_the_page_shows_each_operation_its_phase_and_a_history_newest_first(server, tmp_path, screenshots):
    process, gate, checkpoints = server
    with chromium() as browser:
        browser.get(process.url + "/")
        wait_for(browser, lambda b: text(b, "phase") == "ready" and visible(b, "serving"), "ready")
        assert not visible(browser, "operations")

        replies = {}
        swap = threading.Thread(
            target=lambda: replies.update(swap=post(process, "swap", {"model": str(checkpoints["qwen"])}))
        )
        swap.start()
        try:
            wait_for(browser, shows("swapping", ("swap", "running"), 1), "the swap running")
            wait_for(browser, lambda b: state_of(b, "load_model") == "running", "the swap's load_model running")
            assert history(browser)[0][1] == f"model={checkpoints['qwen']}" and history(browser)[0][3] == "…"
            assert not visible(browser, "serving") and "swap since" in text(browser, "clock")
        finally:
            open_gate(gate)
            swap.join(120)
        assert replies["swap"].status_code == 200 and replies["swap"].json()["state"] == "ready"
        wait_for(browser, shows("ready", ("swap", "ok"), 1), "the swap done")
        assert all(state_of(browser, stage) in ("done", "skipped") for stage in ("load_model", *RELEASED))

        missing = tmp_path / MARK  # weights of another model (the llama's, no biases) for the qwen now served
        shutil.copytree(checkpoints["llama"], missing)
        refused = post(process, "weights", {"path": str(missing)})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "operation_refused"
        wait_for(browser, shows("ready", ("weights", "refused"), 2), "the refused weights update")
        weights = history(browser)[0]
        assert weights[1] == f"path={missing}" and "check_weights" in weights[4], weights

        assert post(process, "sleep", {"level": 1}).json()["state"] == "asleep"
        wait_for(browser, shows("asleep", ("sleep", "ok"), 3), "asleep")
        wait_for(browser, lambda b: [state_of(b, s) for s in RELEASED] == ["pending"] * 3, "the released stages")
        assert state_of(browser, "load_model") == "done"  # level 1: the weights are in host memory, not dropped
        assert "POST /v1/bootstrap/wake" in text(browser, "phase-note") and not visible(browser, "serving")
        browser.save_screenshot(str(screenshots / "status-page-asleep.png"))

        assert post(process, "wake", {}).json()["state"] == "ready"
        wait_for(browser, shows("ready", ("wake", "ok"), 4), "awake")
        wait_for(browser, lambda b: state_of(b, "scheduler_sampler") == "done", "the stages built again")
        rows = history(browser)
        assert [(r[0], r[1], r[2]) for r in rows] == [
            ("wake", "level=1", "ok"),
            ("sleep", "level=1", "ok"),
            ("weights", f"path={missing}", "refused"),
            ("swap", f"model={checkpoints['qwen']}", "ok"),
        ]
        assert all(r[3].endswith(("ms", " s")) for r in rows) and [r[4] for r in rows if r[2] == "ok"] == [""] * 3
        assert not visible(browser, "phase-note")
        assert browser.execute_script(ELEMENTS) == 0  # the error's markup stayed text
        assert console_errors(browser) == []
