"""``torchrun --nproc-per-node 2 -m bootstrap run --tp 2`` is ``bootstrap run --tp 2``: two real
ranks over gloo on the CPU, started once by torch's own launcher (``torchrun``) and once by the
command itself (``bootstrap.parallel.launch``, the same elastic agent). Same ranks, same
environment contract, same output; and under torchrun a missing ``--tp`` is refused on every
rank, said once, before any stage runs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tiny_models import save_checkpoint

ROOT = Path(__file__).parents[2]
RUN = [
    "run",
    "--device",
    "cpu",
    "--prompt",
    "w5 w17 w33",
    "--max-tokens",
    "8",
    "--temperature",
    "0",
    "--max-seq-len",
    "64",
    "--max-batch-size",
    "4",
    "--max-num-tokens",
    "128",
    "--no-plan-cache",
    "--dist-timeout",
    "60",
]
TORCHRUN = shutil.which("torchrun") or ""


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("parity") / "llama")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched(argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def torchrun(*argv: str) -> subprocess.CompletedProcess:
    return launched([TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "bootstrap", *argv])


def same_run(result: dict) -> dict:
    """What must match: the text, tokens, stages and the plan's sizes (not its measured bytes)."""
    plan = {k: v for k, v in result["plan"].items() if not k.endswith("_bytes") and k not in ("profile", "pools")}
    return {
        "text": result["text"],
        "token_ids": result["token_ids"],
        "finish_reason": result["finish_reason"],
        "stages": [(s["id"], s["outcome"], s["attempts"]) for s in result["stages"]],
        "plan": plan,
        "error": result["error"],
    }


@pytest.mark.skipif(not TORCHRUN, reason="torch ships torchrun; this environment has no console script for it")
def test_torchrun_and_tp_2_give_the_same_run(llama):
    ours = launched([sys.executable, "-m", "bootstrap.cli", *RUN, "--model", str(llama), "--tp", "2", "--json"])
    theirs = torchrun(*RUN, "--model", str(llama), "--tp", "2", "--json")
    assert (ours.returncode, theirs.returncode) == (0, 0), ours.stderr[-2000:] + theirs.stderr[-2000:]
    mine, torch_s = json.loads(ours.stdout), json.loads(theirs.stdout)  # one object each: rank 1 printed nothing
    assert same_run(mine) == same_run(torch_s) and mine["error"] is None and len(mine["token_ids"]) == 8
    assert ours.stderr == ""  # --json: nothing else, from either rank or the launcher


@pytest.mark.skipif(not TORCHRUN, reason="torch ships torchrun; this environment has no console script for it")
def test_the_start_line_is_printed_once_under_either_launcher(llama):
    for done in (
        launched([sys.executable, "-m", "bootstrap.cli", *RUN, "--model", str(llama), "--tp", "2"]),
        torchrun(*RUN, "--model", str(llama), "--tp", "2"),
    ):
        assert done.returncode == 0, done.stderr[-2000:]
        starts = [line for line in done.stderr.splitlines() if line.startswith("bootstrap run: ")]
        assert starts == [f"bootstrap run: {llama} on cpu x2 ranks (native backend)"]
        assert done.stderr.count("resolve_classes    started") == 1  # rank 0's progress only


@pytest.mark.skipif(not TORCHRUN, reason="torch ships torchrun; this environment has no console script for it")
@pytest.mark.parametrize("late", [0, 3], ids=["together", "rank-0-starts-3s-late"])
def test_torchrun_without_tp_is_refused_once_before_any_stage(llama, late, tmp_path):
    # Rank 1 refuses first when rank 0 starts late (a loaded machine: CI met it); torchrun then
    # SIGTERMs the rest at once, so rank 1 must wait for rank 0 to say it and end the run.
    script = tmp_path / "late_rank_0.py"
    script.write_text(
        f"import os, time\nif os.environ['RANK'] == '0':\n    time.sleep({late})\n"
        "from bootstrap.cli.entry import entry\nentry()\n"
    )
    done = launched(
        [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(script), *RUN, "--model", str(llama)]
    )
    ours = [line for line in done.stderr.splitlines() if line.startswith("bootstrap: ")]
    assert ours == ["bootstrap: tensor_parallel_size: 1, but the launcher started 2 ranks (WORLD_SIZE 2); pass --tp 2"]
    assert "resolve_classes" not in done.stderr and done.returncode != 0  # torchrun's own status for failed ranks
