"""``benchmarks/serve_profile.py``'s reading of what py-spy records (it needs py-spy, so the whole
script runs only on the device): py-spy's raw lines per thread, a stack's category by its frames
(an idle socket poll is idle, whatever called it; the engine's round send is the channel's), the
shares of the window, and the engine's process found under a real server's (none with
``--engine-in-process``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers.serve_process import ServeProcess

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = {
    "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "torch_dtype": "float32",
}  # fmt: skip


@pytest.fixture(scope="module")
def profile():
    sys.path.insert(0, str(BENCHMARKS))  # its own imports (serve_load, bench_common) are siblings
    try:
        spec = importlib.util.spec_from_file_location("serve_profile", BENCHMARKS / "serve_profile.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


RAW = [
    "thread (0x7F01): MainThread;run (asyncio/runners.py:118);select (selectors.py:468) 40",
    "thread (0x7F01): MainThread;stream_body (bootstrap/serve/openai/render.py:135);"
    "token_chunk (bootstrap/serve/openai/render.py:60) 10",
    "thread (0x7F02): bootstrap-client;_run (bootstrap/engine/executor/channel/threads.py:49);"
    "poll (zmq/sugar/poll.py:106) 45",
    "thread (0x7F02): bootstrap-client;_run (bootstrap/engine/executor/channel/threads.py:52);"
    "_received (bootstrap/engine/executor/channel/client.py:180) 5",
    "thread (0x7F03): bootstrap-executor;step (bootstrap/engine/executor/loop.py:90);"
    "_deliver (bootstrap/engine/executor/channel/engine_side.py:97);send (zmq/sugar/socket.py:713) 50",
]


def test_each_thread_s_samples_fall_in_their_categories_as_shares_of_the_window(profile, tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join(RAW) + "\n")
    rows = profile.read_raw(raw)
    assert [(tid, name, count) for tid, name, _, count in rows] == [
        ("0x7F01", "MainThread", 40), ("0x7F01", "MainThread", 10), ("0x7F02", "bootstrap-client", 45),
        ("0x7F02", "bootstrap-client", 5), ("0x7F03", "bootstrap-executor", 50),
    ]  # fmt: skip
    threads = profile.breakdown(rows, expected=50)
    assert threads["MainThread"]["categories"] == {"idle: event loop (select)": 0.8, "render (chunks, JSON)": 0.2}
    assert threads["bootstrap-client"]["categories"] == {
        "idle: a socket's poll (the channel's threads)": 0.9,
        "channel: receive (decode, route)": 0.1,
    }
    assert threads["bootstrap-executor"]["categories"] == {"channel: rounds (encode, send)": 1.0}
    assert threads["bootstrap-executor"]["top_leaves"] == {"send (zmq/sugar/socket.py:713)": 1.0}
    assert threads["MainThread"]["share_of_window"] == 1.0 and threads["MainThread"]["threads"] == 1


@pytest.mark.parametrize("flags", [(), ("--engine-in-process",)])
def test_the_engine_s_process_is_found_under_the_server_s(profile, tmp_path, flags):
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps(TINY))
    server = ServeProcess(tmp_path / "serve.log", "--model", f"random:{shape}", *flags)
    try:
        server.wait_state("ready")
        engine = profile.engine_pid(server.proc.pid)
        if flags:
            assert engine is None
        else:
            assert b"bootstrap.api.engine_process" in Path(f"/proc/{engine}/cmdline").read_bytes()
            assert Path(f"/proc/{engine}/stat").read_text().rpartition(")")[2].split()[1] == str(server.proc.pid)
    finally:
        server.proc.terminate()
        assert server.proc.wait(60) == 0, server.log()[-3000:]
