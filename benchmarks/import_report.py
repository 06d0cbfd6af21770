"""What a fresh ``bootstrap`` process imports, from ``python -X importtime``: the import time of
the hot path, its heaviest top-level packages, and whether transformers was imported at all.

Runs ``python -X importtime -m bootstrap.cli ARGS...`` in a fresh process; for ``serve`` (which
does not exit) it waits until ``GET /ready`` answers 200 (the executor built) and then stops
the server with SIGINT. The command's stdout goes to ``OUT.stdout``, the import log to
``OUT.importtime.log``. Prints JSON and writes it to ``--out``:

    python benchmarks/import_report.py --out run.json -- run --model DIR --prompt hi --max-tokens 4
    python benchmarks/import_report.py --out serve.json -- serve --model DIR --port 8011

``import_s``: the sum of every module's own import time (what importing cost the process);
``packages``: the same per top-level package, heaviest first; ``transformers``: whether any
``transformers`` module was imported.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path


def parse_importtime(text: str) -> dict:
    """Every module of ``-X importtime`` output, its own (self) time summed per top-level package."""
    packages: dict[str, float] = defaultdict(float)
    modules: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2 or "cumulative" in line:
            continue
        own, _, name = line[len("import time:") :].split("|")
        modules.add(name.strip())
        packages[name.strip().split(".")[0]] += int(own) / 1e6
    top = sorted(packages.items(), key=lambda kv: -kv[1])
    return {
        "import_s": round(sum(packages.values()), 3),
        "modules": len(modules),
        "transformers": any(m == "transformers" or m.startswith("transformers.") for m in modules),
        "packages": {name: round(seconds, 3) for name, seconds in top[:12]},
    }


def run(args: list[str], log: Path, timeout_s: float) -> dict:
    started = time.perf_counter()
    with log.open("w") as err, log.with_suffix(".stdout").open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "bootstrap.cli", *args], stdout=out, stderr=err
        )
        ready_s = _wait_ready(proc, args, timeout_s, started) if args and args[0] == "serve" else None
        code = proc.wait(timeout=timeout_s)
    return {"code": code, "wall_s": round(time.perf_counter() - started, 2), "ready_s": ready_s}


def _wait_ready(proc: subprocess.Popen, args: list[str], timeout_s: float, started: float) -> float | None:
    port = args[args.index("--port") + 1] if "--port" in args else "8000"
    deadline = time.monotonic() + timeout_s
    ready = None
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as answer:
                if answer.status == 200:
                    ready = round(time.perf_counter() - started, 2)
                    break
        except OSError:
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    return ready


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the process is given up")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the bootstrap command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    log = (args.out or Path("import_report.json")).with_suffix(".importtime.log")
    result = {
        "benchmark": "import_report",
        "command": ["bootstrap", *command],
        **run(command, log, args.timeout),
        **parse_importtime(log.read_text()),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
