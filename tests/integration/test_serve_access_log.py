"""``bootstrap serve``'s access log: off by default, so a probe loop on ``GET /ready`` leaves the
server's own lines readable; ``--access-log`` turns it on. Read from the real server's log, after
the server has stopped (nothing left to write)."""

from __future__ import annotations

import httpx
import pytest
from helpers.serve_process import ServeProcess


@pytest.mark.parametrize("flags", [(), ("--access-log",)], ids=["default", "access-log"])
def test_readiness_probes_are_logged_only_with_access_log(flags, tmp_path):
    server = ServeProcess(tmp_path / "serve.log", "--idle", "--no-plan-cache", *flags)
    try:
        for _ in range(5):
            assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 503  # idle: no model yet
        assert server.signal() == 0
    finally:
        server.stop()
    log = server.log()
    probes = [line for line in log.splitlines() if '"GET /ready HTTP/1.1" 503' in line]
    assert "Uvicorn running on" in log and "no thread left" in log  # the server's own lines stay
    assert len(probes) == (5 if flags else 0), log
