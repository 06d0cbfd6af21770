"""A benchmark script run as a user runs it (its own process, from the repository root) where its
requests or starts fail: it exits 1 with no traceback, says why in one line on stderr, and still
writes its JSON (``benchmarks/bench_common.failure_exit``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def failed_run(script: str, argv: list[str], out: Path) -> tuple[str, dict[str, Any]]:
    """Run ``benchmarks/<script>.py argv --out out``, assert the failure's exit, and return its one
    line on stderr (starting ``<script>:``) and the JSON it wrote."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=BENCHMARKS.parent,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [reason] = [line for line in proc.stderr.splitlines() if line.startswith(f"{script}:")]
    return reason, json.loads(out.read_text())
