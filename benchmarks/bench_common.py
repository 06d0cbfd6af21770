"""What the benchmarks share: the environment record, device sync and memory release, output.

The scripts put this directory on ``sys.path`` first, so this module imports the same whether a
script runs as ``python benchmarks/<script>.py`` or is loaded by path in a test. torch and
transformers are imported only by the functions that need them, so a client-side script (the
load generator of ``serve_load.py``) can use the output helpers without paying for them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when torch sees one, else the CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Collect garbage and hand torch's cached blocks back, so the next build starts clean."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def environment(device: torch.device) -> dict[str, Any]:
    """Device, memory, library versions and the date: what a result needs to be compared later."""
    import torch
    import transformers

    env: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        env.update(
            device_name=torch.cuda.get_device_name(device),
            total_bytes=total,
            free_bytes_at_start=free,
            cuda=torch.version.cuda,
        )
    return env


def command_line(script: str, argv: list[str] | None) -> str:
    return " ".join(["python", f"benchmarks/{script}", *(argv if argv is not None else sys.argv[1:])])


def report_header(name: str, argv: list[str] | None, device: torch.device) -> dict[str, Any]:
    """What every result starts with: the benchmark, the command that ran it, the environment."""
    return {"benchmark": name, "command": command_line(f"{name}.py", argv), "environment": environment(device)}


def save(report: dict[str, Any], out: Path | None) -> str:
    """Write the report as JSON to ``out`` (parents created), also part way through a run, so a
    run stopped at its deadline still leaves what it measured; the JSON text."""
    text = json.dumps(report, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Print the finished report as JSON and write it to ``out``."""
    print(save(report, out))


def failure(exc: BaseException) -> dict[str, str]:
    """A measurement that could not be made, recorded instead of ending the run."""
    return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def error_line(error: Any, limit: int = 300) -> str:
    """An error's first non-blank line, cut at ``limit``: of a JSON answer (text or parsed), its
    ``error.message`` (or ``error``, ``detail``) when it has one."""
    if isinstance(error, bytes):
        error = error.decode(errors="replace")
    if isinstance(error, str):
        with contextlib.suppress(ValueError):
            error = json.loads(error)
    if isinstance(error, dict):
        inner = error.get("error", error.get("detail", error))
        error = inner.get("message", inner) if isinstance(inner, dict) else inner
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")[:limit]


def count_failures(outcomes: Iterable[tuple[int | str | None, Any]]) -> dict[str, Any]:
    """Requests' outcomes, each (HTTP status, None for no answer or a label such as ``"exit 2"``
    for a process; error or None), counted: how many ``requests``, how many ``failed``, each
    failure's status with its count (``statuses``: ``"none"`` where no answer came) and the first
    failure's first line (``first_error``)."""
    requests, statuses, first = 0, Counter[str](), None
    for status, error in outcomes:
        requests += 1
        if error is None:
            continue
        statuses["none" if status is None else str(status)] += 1
        first = first if first is not None else error_line(error)
    return {"requests": requests, "failed": statuses.total(), "statuses": dict(statuses), "first_error": first}


def merge_failures(counts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """``count_failures`` results summed: the statuses added up, the first of their first errors."""
    requests, statuses, first = 0, Counter[str](), None
    for count in counts:
        requests += count["requests"]
        statuses.update(count["statuses"])
        first = first if first is not None else count["first_error"]
    return {"requests": requests, "failed": statuses.total(), "statuses": dict(statuses), "first_error": first}


def failure_exit(name: str, failures: dict[str, Any], what: str = "requests") -> int:
    """The exit status of a benchmark from its failure count: 0 when it measured something and
    nothing failed; else 1, after one line on stderr: how many failed, their HTTP statuses, the
    first error's first line."""
    failed, total = failures["failed"], failures["requests"]
    if total and not failed:
        return 0
    if not total:
        print(f"{name}: no {what} were measured", file=sys.stderr)
        return 1
    statuses = ", ".join(f"{_status(status)} x{n}" for status, n in failures["statuses"].items())
    print(f"{name}: {failed} of {total} {what} failed ({statuses}): {failures['first_error']}", file=sys.stderr)
    return 1


def _status(status: str) -> str:
    return "no answer" if status == "none" else f"HTTP {status}" if status.isdigit() else status


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator is not None and denominator else None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected an integer >= 1, got {text!r}")
    return value


def client_processes() -> int:
    """The default count of processes a load's streaming clients are split over: a quarter of the
    cores, at most 4 (one Python client process caps near a core of parsing)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def stat_fields(pid: int | str) -> list[str]:
    """``/proc/PID/stat`` after the command's name: the state is ``[0]``, the parent ``[1]``."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far, from ``/proc``."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pid(server_pid: int) -> int | None:
    """The engine's process under the server (``bootstrap.api.engine_process``), None when it runs in the server's."""
    for entry in Path("/proc").iterdir():
        try:
            parent = entry.name.isdigit() and stat_fields(entry.name)[1]
            if parent == str(server_pid) and b"bootstrap.api.engine_process" in Path(entry, "cmdline").read_bytes():
                return int(entry.name)
        except OSError:  # gone meanwhile
            continue
    return None


def int_list(text: str) -> list[int]:
    """``"1,16,64"`` as ``[1, 16, 64]`` (an argparse ``type``)."""
    return [int(v) for v in text.split(",")]


def name_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``choices``."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        names = text.split(",")
        if any(name not in allowed for name in names):
            raise argparse.ArgumentTypeError(f"each of {', '.join(allowed)}, comma-separated, not {text!r}")
        return names

    return parse


def graph_replay_us(call, replays: int) -> float:
    """Microseconds per replay of ``call`` captured as one CUDA graph (run once before the capture,
    so Triton compiles outside it; three replays to warm up; CUDA events over ``replays``)."""
    import torch

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays * 1000


def server_env(caches: Path) -> dict[str, str]:
    """The environment of a ``bootstrap serve`` subprocess: Triton's and inductor's caches under
    ``caches``, output unbuffered, this checkout first on ``PYTHONPATH``."""
    root = str(Path(__file__).resolve().parent.parent)
    return {
        **os.environ,
        "TRITON_CACHE_DIR": str(caches / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }


def measure_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write), best of 12."""
    import time

    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(12):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * (nbytes // 2) * 2 / best
