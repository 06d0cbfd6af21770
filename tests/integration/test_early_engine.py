"""``bootstrap serve`` starts the engine's process before its own imports (``bootstrap.cli.entry``),
and never leaves one behind: a refused flag stops it, a server the parser keeps in one process
(``--engine-in``, an abbreviation the glance does not read) stops it before its port opens, and
one the parser reads other flags for (``--log-lev debug``) is replaced by one with those."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers.serve_backends import plugin_module
from helpers.serve_process import ROOT, TESTS, ServeProcess, children
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint

SPY = """
import json, subprocess, sys
real = subprocess.Popen
HEAVY = ("bootstrap.cli.main", "bootstrap.config", "pydantic", "fastapi", "opentelemetry", "torch")

class Spy(real):
    def __init__(self, argv, *args, **kwargs):
        super().__init__(argv, *args, **kwargs)
        if "bootstrap.api.engine_process" in argv:
            loaded = sorted({m.split(".")[0] if m.split(".")[0] != "bootstrap" else m for m in sys.modules
                             if m.startswith(HEAVY)})
            print(json.dumps({"engine": self.pid, "loaded": loaded}), flush=True)

subprocess.Popen = Spy
sys.argv = ["bootstrap", *sys.argv[1:]]
from bootstrap.cli.entry import entry
entry()
"""


def test_the_engine_starts_before_the_command_s_imports_and_a_refused_flag_stops_it(tmp_path):
    checkpoint = save_checkpoint("llama", tmp_path / "llama", CHAT_TEMPLATE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "TMPDIR": str(tmp_path)}
    argv = ["serve", "--model", str(checkpoint), "--device", "cpu", "--port", "0", "--drain-timeout", "-1"]
    done = subprocess.run([sys.executable, "-c", SPY, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "drain_timeout" in done.stderr
    [line] = done.stdout.splitlines()
    spawned = json.loads(line)
    assert spawned["loaded"] == []  # none of the command's imports had run
    assert not Path(f"/proc/{spawned['engine']}").exists()  # killed and reaped
    assert not list(tmp_path.glob("bootstrap-engine-*"))  # its sockets' directory removed


def serve(tmp: Path, *flags: str) -> ServeProcess:
    checkpoint = save_checkpoint("llama", tmp / "llama", CHAT_TEMPLATE)
    backend = plugin_module(tmp, step_delay_s=0.0)
    argv = ("--model", str(checkpoint), "--no-plan-cache", "--backend-factory", backend, *flags)
    return ServeProcess(tmp / "serve.log", *argv, pythonpath=(tmp,))  # back once the port is open


def test_a_server_the_parser_keeps_in_one_process_stops_the_early_engine(tmp_path):
    server = serve(tmp_path, "--engine-in")
    try:
        assert children(server.proc) == []
        assert server.signal(signal.SIGTERM) == 0
    finally:
        server.stop()


def test_an_engine_started_with_other_flags_is_replaced(tmp_path):
    server = serve(tmp_path, "--log-lev", "debug")
    try:
        [engine] = children(server.proc)
        assert Path(f"/proc/{engine}/cmdline").read_bytes().split(b"\0")[-3:-1] == [b"debug", b"-"]
        server.wait_state("ready")
        assert server.signal(signal.SIGTERM) == 0
    finally:
        server.stop()
