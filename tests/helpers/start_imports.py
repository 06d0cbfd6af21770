"""What a fresh ``bootstrap`` process imported, read from ``python -X importtime``'s lines (every
module the process imported, lazily or not, once each), and the modules its start must not pull
in: each costs seconds of a cold start (sympy through dynamo: 3 s on an H100 host)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers.serve_process import ROOT

# transformers: the native backend reads checkpoints itself (the transformers fallback may import it)
DENIED = ("sympy", "torch._dynamo", "torch._inductor", "transformers")
_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)\s*$", re.MULTILINE)


def imported(log: str) -> set[str]:
    """The modules named by ``-X importtime`` lines in ``log``."""
    return set(_LINE.findall(log))


def denied(modules: set[str]) -> list[str]:
    """The modules of ``modules`` that are, or are inside, one of ``DENIED``."""
    return sorted(m for m in modules if any(m == d or m.startswith(d + ".") for d in DENIED))


LIMITS = ("--max-batch-size", "4", "--max-num-tokens", "16", "--max-seq-len", "128", "--no-plan-cache")
PROMPT = " ".join(f"w{3 + i % 200}" for i in range(40))  # 40 tokens: chunks of 16, 16 and 8


def run_log(model: Path, device: str) -> str:
    """The ``-X importtime`` log of a fresh ``bootstrap run`` answering ``PROMPT`` on ``device``."""
    command = [sys.executable, "-X", "importtime", "-m", "bootstrap.cli", "run", "--model", str(model)]
    command += ["--device", device, "--prompt", PROMPT, "--max-tokens", "4", *LIMITS]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr
