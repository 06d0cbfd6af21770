"""``bootstrap run``: a failure after the executor is ready is reported like one before it
(issue 20, item 7): one paragraph on stderr, no traceback, exit 1 (``STAGE_FAILED``), and under
``--json`` exactly one object on stdout with its ``error``.

Killing rank 1 of a ``--tp 2`` run after ready ended in ``RuntimeError: generation failed``
escaping as a traceback, with no ``--json`` object. Here the stages run on the simulated GPU and
the ready executor is replaced by one that fails each way an answer can: the request ends with a
step's error, its stream raises (a collective that lost a rank), or ``enqueue`` raises.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tiny_models import save_checkpoint

from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.cli import run as run_command
from bootstrap.cli.exits import STAGE_FAILED
from bootstrap.cli.main import main
from bootstrap.engine.request.sequence import StreamEvent
from bootstrap.stages import STAGE_IDS

GLOO = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer\n  [127.0.0.1]:29500"


class FailingExecutor:
    """A ready executor whose answer fails as ``how`` says; ``shutdown`` is all it needs besides."""

    tokenizer = None
    is_running = True

    def __init__(self, how: str) -> None:
        self.how = how

    def enqueue(self, prompt_token_ids, params=None) -> int:
        if self.how == "enqueue":
            raise RuntimeError("the executor is shut down; build a new one")
        return 1

    async def stream_async(self, request_id, *, cancel_on_abandon=False):
        yield StreamEvent(7, "w7")
        if self.how == "stream":
            raise RuntimeError("rank 1 stopped answering\n\nwithin --dist-timeout 600 s")
        try:
            raise RuntimeError(GLOO)
        except RuntimeError:  # as the worker logs a failed step: unconfigured logging prints its traceback
            logging.getLogger("bootstrap.engine.executor.py_executor").exception("step of 1 requests failed")
        yield StreamEvent(None, "", "error", GLOO)

    def cancel(self, request_id) -> None:
        pass

    def shutdown(self) -> None:
        pass


def run(monkeypatch, capsys, how: str, *flags: str) -> tuple[int, str, str]:
    monkeypatch.setattr(run_command, "rank_backend", lambda config, args: SimBackend(sim_device("h100-80gb")))
    monkeypatch.setattr(run_command, "require_requests", lambda executor: FailingExecutor(how))
    code = main(["run", "--model", "llama-3.1-8b", "--no-plan-cache", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def the_paragraph(err: str) -> str:
    """The one error paragraph on stderr (progress lines come before it), checked to be the only one."""
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("bootstrap: ")]
    assert len(errors) == 1, err
    assert err.rstrip().endswith(errors[0])
    return errors[0].removeprefix("bootstrap: ")


@pytest.mark.parametrize("how", ["step", "stream", "enqueue"])
def test_a_failure_after_ready_is_one_json_object_and_one_paragraph(how, monkeypatch, capsys):
    code, out, err = run(monkeypatch, capsys, how, "--json")
    assert code == STAGE_FAILED, err
    result = json.loads(out)  # the whole of stdout: exactly one object
    assert [s["id"] for s in result["stages"]] == list(STAGE_IDS)  # ready: every stage ran
    assert result["error"] == the_paragraph(err)
    assert result["error"].startswith("the generation failed after the executor was ready: ")
    assert "\n" not in result["error"]


def test_a_failed_step_after_ready_names_its_error_without_json(monkeypatch, capsys):
    code, out, err = run(monkeypatch, capsys, "step")
    assert code == STAGE_FAILED, err
    assert the_paragraph(err) == (
        "the generation failed after the executor was ready: RuntimeError: "
        "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"
    )
    assert out.endswith("w7\n")  # the text streamed so far, its line ended
    assert "  engine: step of 1 requests failed\n" in err  # the engine's log: one line, no traceback


RANKS = """
import os, sys

def rank_main(argv):  # rank 1 dies at its third step after ready, as a killed rank would
    if os.environ["RANK"] == "1":
        from bootstrap.backends.native.backend import NativeBackend
        start = NativeBackend.start_executor

        def start_then_die(self, *args, **kwargs):
            executor = start(self, *args, **kwargs)
            run, steps = executor.runner.run, []

            def run_then_die(batch):
                steps.append(batch)
                if len(steps) == 3:
                    os._exit(17)
                return run(batch)

            executor.runner.run = run_then_die
            return executor

        NativeBackend.start_executor = start_then_die
    from bootstrap.cli.main import main
    return main(argv)

if __name__ == "__main__":
    from bootstrap.cli.tp import launched_status
    from bootstrap.parallel.launch import launch
    status, line = launched_status(launch(rank_main, (sys.argv[1:],), 2))  # as launch_ranks does, with the hook
    if line:
        print(f"bootstrap: {line}", file=sys.stderr)
    sys.exit(status)
"""


def test_a_rank_killed_after_ready_is_one_json_object_and_one_paragraph(tmp_path):
    """Two real ranks over gloo on the CPU (about 15 s). Rank 0 reports what it met first: its
    step failing once rank 1 is gone, or the launcher's stop (torch's agent stops the others as
    soon as it sees a rank end); then the launcher's one line names the rank that ended."""
    model = save_checkpoint("llama", tmp_path / "llama")
    (tmp_path / "ranks.py").write_text(RANKS)
    argv = [
        "run",
        "--device",
        "cpu",
        "--model",
        str(model),
        "--tp",
        "2",
        "--prompt",
        "w5 w17",
        "--max-tokens",
        "20",
        "--max-seq-len",
        "64",
        "--max-batch-size",
        "4",
        "--max-num-tokens",
        "128",
        "--dist-timeout",
        "20",
        "--json",
    ]
    done = subprocess.run(
        [sys.executable, str(tmp_path / "ranks.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == STAGE_FAILED, done.stderr[-3000:]
    result = json.loads(done.stdout)  # one object: rank 1 printed nothing
    *before, last = done.stderr.rstrip().splitlines()
    assert last == "bootstrap: rank 1 exited with status 17; the launcher stopped the other ranks"
    acknowledged = "bootstrap: stopped by SIGTERM: shutting the executor down ..."
    if acknowledged in before:  # the launcher's stop came first: said at once, then the outcome
        before.remove(acknowledged)
        assert (
            result["error"]
            == the_paragraph("\n".join(before))
            == "stopped by SIGTERM; completed stages were rolled back"
        )
    else:
        assert result["error"] == the_paragraph("\n".join(before))
        assert result["error"].startswith("the generation failed after the executor was ready: RuntimeError: ")
