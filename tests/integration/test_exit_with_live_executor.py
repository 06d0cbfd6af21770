"""A program that ends with a live executor (no ``shutdown``) exits cleanly (issue 20, item 6).

Before the fix every such exit aborted: the daemon worker, inside a torch call as the interpreter
finalized, was killed by ``pthread_exit`` while retaking the GIL, and the unwind through torch's
C++ frames ended in "terminate called without an active exception" (SIGABRT, rc 134). Each
script builds an executor on the CPU, enqueues long generations and ends without ``shutdown``:
by returning, by an uncaught exception, by ``sys.exit``. A check registered with ``atexit``
before the build runs after the executor's own hook and reports what was left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TINY = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

SCRIPT = """
import asyncio, atexit, json, sys, threading
import bootstrap
from bootstrap.engine import SamplingParams

state = {{}}

def finish_reason(ex, rid):  # never waits: a wait here would let the generations run to their end
    try:
        return ex.await_response(rid, timeout=0).finish_reason
    except TimeoutError:
        return "unfinished"

def report():  # registered first, so it runs after every hook the build registers
    ex = state["executor"]
    finish = [finish_reason(ex, rid) for rid in state["ids"]]
    threads = [t.name for t in threading.enumerate() if t.name.startswith("bootstrap")]
    print(json.dumps({{"finish": finish, "threads": threads}}), flush=True)

atexit.register(report)

async def main():
    config = bootstrap.BootstrapConfig(model="random:{config}", device="cpu", max_num_tokens=64, max_batch_size=4)
    ex, _ = await bootstrap.build_executor(config)
    state["executor"] = ex
    state["ids"] = [ex.enqueue([1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)) for _ in range(3)]

asyncio.run(main())
{end}
"""

ENDS = {"return": ("pass", 0), "uncaught": ('raise RuntimeError("the program failed")', 1), "exit": ("sys.exit(3)", 3)}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.mark.parametrize("end", list(ENDS))
def test_ending_without_shutdown_exits_with_the_programs_status(end, tiny_config, tmp_path):
    statement, expected = ENDS[end]
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(SCRIPT.format(config=tiny_config, end=statement)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "terminate called" not in done.stderr
    assert done.returncode == expected, done.stderr[-2000:]
    left = json.loads(done.stdout.strip().splitlines()[-1])
    assert left == {"finish": ["cancelled"] * 3, "threads": []}  # in flight at exit: cancelled; no worker left
    if end == "uncaught":
        assert "RuntimeError: the program failed" in done.stderr
