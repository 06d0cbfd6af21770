"""What request tracing costs per request, measured in one warm process (not a server start):
the ``RequestTracing`` middleware and the choice spans (``bootstrap.serve.request_trace``)
around a handler that does nothing else, with the trace file exported as the server does it
(request spans in batches from a background thread).

For each setting (``none``: no middleware; R: the middleware at ratio R), ``--requests`` ASGI
calls are made back to back, each with one choice of 32 prompt and 16 output tokens, and the
time per request is taken twice: on the calling thread (what the event loop spends) and as the
process's CPU time until every span is in the file (the batch thread included). Settings are
measured one right after the other, ``--rounds`` times, rotating which goes first; the medians
and their ratio to ``none`` are the result. The figure is the per-request overhead; a server's
throughput cost is that overhead against its own time per request (``serve_load.py --trace-ratios``).

    python benchmarks/request_trace_cost.py --requests 5000 --rounds 5 \\
        --out benchmarks/results/request_trace_cost_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when loaded by path
from bench_common import emit

from bootstrap.engine.request.timing import RequestTiming
from bootstrap.pipeline.telemetry import TRACER_NAME, make_tracer_provider
from bootstrap.serve.request_trace import SCOPE_KEY, RequestTracing, record_choices

SCOPE = {
    "type": "http",
    "method": "POST",
    "path": "/v1/completions",
    "headers": [(b"content-type", b"application/json")],
}


def handler(tracer):
    async def app(scope, receive, send) -> None:
        now = time.time_ns()
        job = SimpleNamespace(
            timing=RequestTiming(now - 3_000_000, now - 2_900_000, now - 2_000_000, now, 1, 2),
            tokens=16,
            reason="length",
            request_id=1,
            prompt_tokens=32,
            error=None,
        )
        record_choices(scope.get("state", {}).get(SCOPE_KEY), tracer, "completion", [job], 32)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


async def calls(app, count: int) -> None:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message) -> None:
        pass

    for _ in range(count):
        await app(dict(SCOPE, state={}), receive, send)


def measure(ratio: float | None, count: int) -> dict:
    provider = make_tracer_provider(trace_file=Path(tempfile.mkdtemp()) / "trace.jsonl", requests=True)
    tracer = provider.get_tracer(TRACER_NAME)
    app = handler(tracer) if ratio is None else RequestTracing(handler(tracer), tracer=lambda: tracer, ratio=ratio)
    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.run(calls(app, count))
    loop_s = time.perf_counter() - wall
    provider.shutdown()  # every span written: the batch thread's work counted in the CPU time
    return {"ratio": ratio, "loop_us": loop_s / count * 1e6, "cpu_us": (time.process_time() - cpu) / count * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    settings = [None, 0.0, 0.1, 1.0]
    runs: dict[float | None, list[dict]] = {s: [] for s in settings}
    measure(1.0, 200)  # warm the imports and the exporter
    for round_number in range(args.rounds):
        for i in range(len(settings)):
            setting = settings[(i + round_number) % len(settings)]
            runs[setting].append(measure(setting, args.requests))
    base = {k: statistics.median(r[k] for r in runs[None]) for k in ("loop_us", "cpu_us")}
    rows = []
    for setting, each in runs.items():
        medians = {k: statistics.median(r[k] for r in each) for k in ("loop_us", "cpu_us")}
        rows.append(
            {
                "setting": "none" if setting is None else setting,
                "rounds": len(each),
                "loop_us_per_request": round(medians["loop_us"], 1),
                "cpu_us_per_request": round(medians["cpu_us"], 1),
                "added_loop_us": round(medians["loop_us"] - base["loop_us"], 1),
                "added_cpu_us": round(medians["cpu_us"] - base["cpu_us"], 1),
            }
        )
    result = {
        "command": " ".join(["request_trace_cost.py", *(argv if argv is not None else sys.argv[1:])]),
        "environment": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "warm_process": True,
        "requests_per_round": args.requests,
        "settings": rows,
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
