"""Every flag of ``run`` and ``serve`` is checked before any work (issue 20, item 10): exit 2 and
one line naming the flag (as its field, as every error here does; several bad fields share the
line) and its allowed range, in well under a second of work, before any stage runs and (serve)
before the port opens. The console script runs in a subprocess, as a user meets it; a bad value
the old code let through ran the stages (a line per stage) or started the server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from helpers.start_imports import imported

MODEL = ["--model", "random:smollm2-135m", "--device", "cpu", "--no-plan-cache"]
CLI = [sys.executable, "-m", "bootstrap.cli"]
PORT = {"run": [], "serve": ["--port", "0"]}  # serve: any free port, were it ever opened
CASES = [  # (command, flags, what the one line names)
    ("run", ["--temperature", "nan"], "temperature"),
    ("run", ["--temperature", "inf"], "temperature"),
    ("run", ["--temperature", "-1"], "temperature"),
    ("run", ["--dist-timeout", "nan"], "dist_timeout"),
    ("run", ["--dist-timeout", "inf"], "dist_timeout"),
    ("run", ["--dist-timeout", "0"], "dist_timeout"),
    ("run", ["--dist-timeout", "-1"], "dist_timeout"),
    ("run", ["--seed", "-1"], "seed"),
    ("run", ["--max-kv-tokens", "1"], "max_kv_tokens"),
    ("run", ["--max-kv-tokens", "100", "--max-seq-len", "512", "--max-num-tokens", "64"], "max_kv_tokens"),
    ("run", ["--free-gpu-memory-fraction", "nan"], "free_gpu_memory_fraction"),
    ("serve", ["--shutdown-timeout", "nan"], "shutdown_timeout"),
    ("serve", ["--shutdown-timeout", "inf"], "shutdown_timeout"),
    ("serve", ["--shutdown-timeout", "-1"], "shutdown_timeout"),
    ("serve", ["--drain-timeout", "nan"], "drain_timeout"),
    ("serve", ["--drain-timeout", "-1"], "drain_timeout"),
    ("serve", ["--host", "256.0.0.1"], "host"),
    ("serve", ["--request-trace-ratio", "1.5"], "request_trace_ratio"),
    ("serve", ["--request-trace-ratio", "nan"], "request_trace_ratio"),
    ("serve", ["--max-kv-tokens", "1"], "max_kv_tokens"),
    ("serve", ["--free-gpu-memory-fraction", "inf"], "free_gpu_memory_fraction"),
    ("run", ["--max-seq-len", "100000"], "max_seq_len"),  # past the model's max_position_embeddings
    ("serve", ["--max-seq-len", "100000"], "max_seq_len"),
]


@pytest.mark.parametrize(("command", "flags", "name"), CASES, ids=[f"{c}{' '.join(f)}" for c, f, _ in CASES])
def test_a_bad_value_exits_2_at_once_with_one_line_naming_the_flag(command, flags, name, tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}  # no plan or model cache of the user's touched
    start = time.monotonic()
    try:
        done = subprocess.run(
            [*CLI, command, *MODEL, *PORT[command], *flags], capture_output=True, text=True, timeout=30, env=env
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} {flags}: still running after 30 s (the bad value was not refused)")
    elapsed = time.monotonic() - start
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and name in lines[0], done.stderr
    assert "must be" in lines[0] or "allowed" in lines[0], done.stderr  # and its allowed range
    assert "bootstrap serve:" not in done.stderr and "bootstrap run:" not in done.stderr  # nothing started
    assert "Uvicorn" not in done.stderr and done.stdout == ""
    assert elapsed < 10, f"took {elapsed:.1f} s"  # the imports only; no stage, no port


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_value_the_model_bounds_is_refused_before_torch_is_imported(command, llama, tmp_path):
    """``--max-seq-len`` past a checkpoint's max_position_embeddings: refused from its config.json,
    not in ``resolve_classes`` after the engine's imports (torch alone is seconds)."""
    env = {**os.environ, "HOME": str(tmp_path)}
    argv = [sys.executable, "-X", "importtime", "-m", "bootstrap.cli", command, "--model", str(llama)]
    done = subprocess.run(
        [*argv, *PORT[command], "--max-seq-len", "100000"], capture_output=True, text=True, timeout=60, env=env
    )
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("import time:")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "max_seq_len: 100000 exceeds" in lines[0] and "allowed 2..512" in lines[0]
    modules = imported(done.stderr)
    assert "bootstrap.cli.args" in modules and "torch" not in modules


def test_a_port_in_use_is_refused_before_any_stage_naming_the_cause(llama, tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*CLI, "serve", "--model", str(llama), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == (
        f"bootstrap: port: cannot listen on 127.0.0.1:{port}: address already in use "
        "(allowed: a port no other process listens on, 1-65535, or 0 for a free one)"
    )
