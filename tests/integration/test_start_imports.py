"""The hot path of a start imports no sympy, dynamo, inductor or transformers: a fresh interpreter
runs ``bootstrap run`` and ``bootstrap serve`` up to a generated answer (a prompt longer than a
step, so continued chunks attend over the cache as well) under ``-X importtime`` (serve's engine
process inherits it and its lines reach the server's log), and the test reads the module set.
A set, not a timing: the guard holds on any machine."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from helpers.serve_process import ROOT, ServeProcess
from helpers.start_imports import DENIED, LIMITS, PROMPT, denied, imported, run_log


def test_run_imports_none_of_the_denied_modules(llama):
    modules = imported(run_log(llama, "cpu"))
    # the reading is real: the engine's attention over the cache and torch were imported
    assert {"torch", "bootstrap.engine.layers.gathered", "bootstrap.backends.native.backend"} <= modules
    assert denied(modules) == [], f"the start imported {denied(modules)[:5]} (denied: {DENIED})"


def test_serve_imports_none_of_them_up_to_a_streamed_answer(checkpoint, tmp_path):
    server = ServeProcess(
        tmp_path / "serve.log", "--model", str(checkpoint), *LIMITS, env={"PYTHONPROFILEIMPORTTIME": "1"}
    )
    try:
        server.wait_state("ready")
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2
    finally:
        server.stop()
    modules = imported(server.log())
    assert {"torch", "bootstrap.engine.layers.gathered", "uvicorn", "fastapi"} <= modules
    assert denied(modules) == [], f"serve imported {denied(modules)[:5]} (denied: {DENIED})"


@pytest.mark.parametrize(
    ("line", "module"),
    [
        ("import time:       838 |        838 | bootstrap", "bootstrap"),
        ("import time:      4343 |     924341 |                               sympy", "sympy"),
        ("import time:      1327 |     101061 |         torch._inductor.config", "torch._inductor.config"),
    ],
)
def test_importtime_lines_are_read_and_denied_modules_found(line, module):
    modules = imported(f"some output\n{line}\nimport time: self [us] | cumulative | imported package\n")
    assert modules == {module}
    assert denied(modules) == ([] if module == "bootstrap" else [module])


def test_the_server_s_own_imports_leave_torch_to_the_engine():
    """The HTTP stack (``bootstrap.serve.app``) imports no torch: the port opens, and the status page
    answers, while the engine imports it (a route's module importing the engine at import time
    delayed the port of an 8B serve on an H100 from 1.5 s to 4.2 s)."""
    assert torch_after_importing("bootstrap.serve.app") == "[]"
    assert torch_after_importing("bootstrap.serve.app", roots=("zmq", "msgspec")) == "[]"  # the channel's, later


@pytest.mark.parametrize(
    "module",
    [
        "bootstrap.engine.executor.channel.client",
        "bootstrap.engine.executor.channel.messages",
        "bootstrap.api.control",
        "bootstrap.serve.startup.remote",
    ],
)
def test_the_server_s_end_of_the_engine_channel_imports_no_torch(module):
    """What the server's side of the channel imports (its client, the messages both ends share,
    the control plane's messages and the server's end of it) holds no torch: the engine's
    process, not the server's, imports it (``test_engine_process`` reads the server's mappings)."""
    assert torch_after_importing(module) == "[]"


def torch_after_importing(module: str, roots: tuple[str, ...] = ("torch",)) -> str:
    """The modules under ``roots`` a fresh interpreter holds after importing ``module``, as a printed list."""
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in {roots!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
