"""Plan-cache entries that are not plans, and caches that cannot be written, met as a user meets
them: ``bootstrap run`` (and once ``bootstrap serve``) in a subprocess on the CPU, with a tiny
``random:`` model. An entry that is no regular file of bounded size, or no valid plan, is ignored
with exactly one warning naming it and why, and the start profiles as without a cache: it never
blocks on a FIFO, never reads a device without end, never fails on JSON nested too deeply. A
read-only cache costs one warning; the plans already in it are still used."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers.serve_process import ServeProcess

from bootstrap.stages.plan_cache import MAX_ENTRY_BYTES

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
}
SMALL = ("--max-tokens", "2", "--max-num-tokens", "64", "--max-batch-size", "4")
PROFILED, FROM_CACHE = ("ok", None), ("skipped", "plan-cache")
# Without CAP_DAC_OVERRIDE root meets file modes as every other user does (it keeps its uid).
AS_A_USER = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")
DENIED = os.strerror(errno.EACCES)


def start(
    model: str,
    *argv: str,
    env: dict[str, str] | None = None,
    prefix: tuple[str, ...] = (),
    memory_bytes: int | None = None,
) -> tuple[dict[str, tuple[str, str | None]], list[str]]:
    """One ``bootstrap run``: each stage's (outcome, skip reason), and its plan-cache warnings.
    A hang fails the test (the timeout) instead of stalling the suite."""

    def limit_memory() -> None:
        if memory_bytes is not None:  # a read without end then fails fast, not by exhausting the machine
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    command = [
        *prefix,
        sys.executable,
        "-m",
        "bootstrap.cli",
        "run",
        "--device",
        "cpu",
        "--model",
        model,
        *SMALL,
        "--json",
        *argv,
    ]
    done = subprocess.run(
        command,
        check=False,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=90,
        preexec_fn=limit_memory,
    )
    assert done.returncode == 0, done.stderr
    stages = {s["id"]: (s["outcome"], s["skip_reason"]) for s in json.loads(done.stdout)["stages"]}
    return stages, [line for line in done.stderr.splitlines() if line.startswith("plan cache:")]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    config = tmp_path_factory.mktemp("tiny") / "config.json"
    config.write_text(json.dumps(TINY))
    return f"random:{config}"


@pytest.fixture(scope="module")
def stored(model, tmp_path_factory) -> Path:
    """The entry the first start of ``model`` stored (its name is the setup's fingerprint)."""
    cache = tmp_path_factory.mktemp("stored")
    stages, warnings = start(model, "--plan-cache", str(cache))
    assert stages["profiling"] == PROFILED and warnings == []
    (entry,) = cache.glob("*.json")
    return entry


@pytest.fixture
def entry(stored, tmp_path) -> Path:
    """Where the next start looks for its plan, in a cache of its own (nothing there yet)."""
    (tmp_path / "plans").mkdir()
    return tmp_path / "plans" / stored.name


def fifo(entry: Path) -> str:
    os.mkfifo(entry)
    return "a FIFO, not a regular file"


def link_to_fifo(entry: Path) -> str:
    os.mkfifo(entry.parent.parent / "fifo")
    entry.symlink_to(entry.parent.parent / "fifo")
    return "a symbolic link, not a regular file"


def link_to_dev_zero(entry: Path) -> str:
    entry.symlink_to("/dev/zero")
    return "a symbolic link, not a regular file"


def nested_too_deeply(entry: Path) -> str:
    entry.write_text("[" * 100_000 + "]" * 100_000)
    return "JSON nested too deeply"


def too_large(entry: Path) -> str:
    entry.write_text(json.dumps({"fingerprint": entry.stem, "padding": "x" * MAX_ENTRY_BYTES}))
    return f"{entry.stat().st_size} bytes, more than the {MAX_ENTRY_BYTES} a plan may hold"


def not_utf8(stored: Path, entry: Path) -> str:
    entry.write_bytes(stored.read_text().encode("utf-16"))  # a valid plan, in another encoding
    return "not UTF-8 text: invalid start byte at byte 0"


def wrong_schema(stored: Path, entry: Path) -> str:
    entry.write_text(json.dumps({**json.loads(stored.read_text()), "profile": [1, 2, 3]}))
    return "TypeError: bootstrap.capacity.plan.MemoryProfile() argument after ** must be a mapping, not list"


DAMAGE = {
    "fifo": fifo,
    "link to a fifo": link_to_fifo,
    "link to /dev/zero": link_to_dev_zero,
    "nested too deeply": nested_too_deeply,
    "too large": too_large,
}
WITH_THE_PLAN = {"not utf-8": not_utf8, "wrong schema": wrong_schema}


@pytest.mark.parametrize("damage", sorted(DAMAGE) + sorted(WITH_THE_PLAN))
def test_an_entry_that_is_no_plan_costs_one_warning_and_the_start_profiles(model, stored, entry, damage):
    reason = DAMAGE[damage](entry) if damage in DAMAGE else WITH_THE_PLAN[damage](stored, entry)
    stages, warnings = start(model, "--plan-cache", str(entry.parent), memory_bytes=6 * 1024**3)
    assert warnings == [f"plan cache: ignoring {entry} ({reason}); profiling again"]
    assert stages["estimation_build"] == stages["profiling"] == PROFILED
    assert entry.is_file() and not entry.is_symlink()  # the fresh plan replaced it (a link itself, not its target)


def test_serve_answers_health_and_stops_on_sigterm_with_an_entry_linked_to_a_fifo(model, entry, tmp_path):
    link_to_fifo(entry)
    server = ServeProcess(tmp_path / "serve.log", "--model", model, *SMALL[2:], "--plan-cache", str(entry.parent))
    try:
        assert server.wait_state("ready", timeout=90)["state"] == "ready"
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert server.signal(signal.SIGTERM, timeout=60) == 0
    finally:
        server.stop()
    assert server.log().count("plan cache: ignoring") == 1


def writes_fail(directory: Path) -> tuple[str, ...]:
    """chmod 0o555 ``directory``; the command prefix under which that stops writes: none for a
    user, ``AS_A_USER`` for root (a mode does not stop root's writes), skipped without setpriv."""
    directory.chmod(0o555)
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: nothing here makes a directory unwritable to root")
    return AS_A_USER


@pytest.fixture
def read_only(tmp_path):
    """A directory made read-only; made writable again for the cleanup."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    yield directory
    directory.chmod(0o755)


def test_a_read_only_home_costs_one_warning_not_the_start(model, read_only):
    prefix = writes_fail(read_only)  # HOME: the default cache ~/.cache/executor-bootstrap/plans cannot be created
    stages, warnings = start(model, env={"HOME": str(read_only)}, prefix=prefix)
    directory = read_only / ".cache" / "executor-bootstrap" / "plans"
    assert warnings == [f"plan cache: cannot write to {directory} ({DENIED}); using the plans there, storing none"]
    assert stages["profiling"] == PROFILED and list(read_only.iterdir()) == []


def test_a_plan_in_a_read_only_cache_is_still_used(model, stored, read_only):
    shutil.copy(stored, read_only / stored.name)
    prefix = writes_fail(read_only)
    stages, warnings = start(model, "--plan-cache", str(read_only), prefix=prefix)
    assert warnings == [f"plan cache: cannot write to {read_only} ({DENIED}); using the plans there, storing none"]
    assert stages["estimation_build"] == stages["profiling"] == FROM_CACHE
    assert [p.name for p in read_only.iterdir()] == [stored.name]
