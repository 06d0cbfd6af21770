"""``bootstrap serve`` under load: requests/s, time to first token and end-to-end latency.

Starts the server in a subprocess (or uses ``--url``), waits for ``/ready``, then for each
concurrency level C runs C clients at once, each sending streaming ``/v1/completions`` requests
back to back until ``--requests`` (per level) have been sent. Prompts are random token ids
(the text each token adds is what arrives; a model needs a tokenizer for TTFT), greedy, ``max_tokens`` = ``--gen-len``.

Per level: ``requests_per_s`` (completed / wall time), ``output_tokens_per_s``, TTFT (request
sent to first text chunk) and end-to-end (request sent to ``[DONE]``) p50 and p99 in ms, and
the failed requests (how many, their HTTP statuses, the first error's first line). The clients run
in this process on the same machine as the server: on a small CPU they share its cores. Prints JSON
and writes it to ``--out``; exit status 1, with one line on stderr, when any request failed.

``--logprobs off,5`` measures each level once per setting (``off``: none asked; K: ``logprobs``
K on every request), on the same server, one right after the other, and adds each setting's
throughput as a ratio to the first one's (``vs_first``): the feature's cost, side by side.

``--trace-ratios none,0,0.1,1`` starts one server per setting (``none``: no trace file; R:
``--trace-file`` and ``--request-trace-ratio R``), all before any is measured, then measures
each level on each server one right after the other, ``--rounds`` times: request tracing's
cost, side by side (which setting goes first rotates from round to round; ``medians`` sums the
rounds up). Each server's trace file is counted afterwards (``traced_requests``).

``--tp-sizes 1,2`` does the same with one server per tensor-parallel size (``serve --tp N``:
rank 0 serves, the others follow), and records each server's spawn -> ``/ready`` 200 in
``spawn_to_ready_s``: the launcher's overhead, side by side.

    python benchmarks/serve_load.py --model smollm2-135m-instruct --device cpu --levels 1,8,32,64 \
        --requests 64 --prompt-len 32 --gen-len 16 --out benchmarks/results/serve_load_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common, also when loaded by path
from bench_common import count_failures, emit, failure_exit, int_list, merge_failures  # noqa: E402

STARTED = re.compile(r"Uvicorn running on (http://[\d.]+:\d+)")


@dataclass
class Sample:
    ttft_s: float | None
    e2e_s: float
    tokens: int
    status: int | None  # None: no answer (the connection failed)
    error: str | None = None  # the server's answer (or the client's exception) when the request failed

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--levels", default="1,8,32,64", help="concurrent clients, comma-separated")
    parser.add_argument("--requests", type=int, default=64, help="requests per level (at least one per client)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152, help="prompt token ids are drawn below this")
    parser.add_argument(
        "--logprobs",
        default="off",
        type=_logprobs_settings,
        help="comma-separated settings measured side by side: off, or K (0-20) logprobs per token",
    )
    parser.add_argument(
        "--trace-ratios",
        default=[None],
        type=_ratio_settings,
        help="comma-separated: none (no trace file) or R in [0, 1], one server each (default: none)",
    )
    parser.add_argument(
        "--tp-sizes",
        default=[1],
        type=int_list,
        help="comma-separated tensor-parallel sizes, one server each (default: 1)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="times each level is measured on each setting")
    parser.add_argument(
        "--serve-args",
        default="",
        help="more flags for every server, one string "
        "(e.g. '--free-gpu-memory-fraction 0.2' for several servers on one GPU)",
    )
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def _ratio_settings(text: str) -> list[float | None]:
    try:
        ratios = [None if v == "none" else float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--trace-ratios: none or a number in [0, 1] each, got {text!r}") from None
    if any(r is not None and not 0 <= r <= 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"--trace-ratios: each in [0, 1], got {text!r}")
    return ratios


def _logprobs_settings(text: str) -> list[int | None]:
    settings = [None if v.strip() == "off" else int(v) for v in text.split(",")]
    if any(v is not None and not 0 <= v <= 20 for v in settings):
        raise argparse.ArgumentTypeError(f"--logprobs: off or 0-20 each, got {text!r}")
    return settings


class Server:
    """``bootstrap serve`` in a subprocess on a free port; SIGTERM on exit."""

    def __init__(self, args: argparse.Namespace, trace_ratio: float | None = None, tp: int = 1) -> None:
        # open for the server's whole life (its stdout), closed in stop()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self.trace_ratio, self.tp = trace_ratio, tp
        self.trace = None if trace_ratio is None else Path(tempfile.mkdtemp()) / "trace.jsonl"
        tracing = (
            [] if self.trace is None else ["--trace-file", str(self.trace), "--request-trace-ratio", str(trace_ratio)]
        )
        command = [
            sys.executable,
            "-m",
            "bootstrap.cli",
            "serve",
            "--model",
            args.model,
            "--device",
            args.device,
            "--port",
            "0",
            "--max-batch-size",
            str(args.max_batch_size),
            "--max-seq-len",
            str(args.max_seq_len),
            "--no-plan-cache",
            "--tp",
            str(tp),
            *tracing,
            *shlex.split(args.serve_args),
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = self._port()
        self.spawn_to_ready_s: float | None = None  # set once /ready answers 200

    def _port(self) -> str:
        while self.proc.poll() is None:
            found = STARTED.search(Path(self.log.name).read_text())
            if found:
                return found.group(1)
            time.sleep(0.05)
        raise RuntimeError(f"bootstrap serve exited:\n{Path(self.log.name).read_text()}")

    def traced_requests(self) -> int | None:
        """Request spans in this server's trace file (after ``stop``: every span is flushed)."""
        if self.trace is None:
            return None
        return sum('"name": "bootstrap.request"' in line for line in self.trace.read_text().splitlines())

    def stop(self) -> int:
        """SIGTERM, wait; the server log is kept (and named on stderr) only when it did not exit 0."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(120)
        self.log.close()
        if code == 0:
            Path(self.log.name).unlink()
        else:
            print(f"bootstrap serve exited with {code}; its log: {self.log.name}", file=sys.stderr)
        return code


async def _ready(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await wait_ready(http)


async def wait_ready(http: httpx.AsyncClient) -> dict:
    while True:
        response = await http.get("/ready")
        if response.status_code == 200:
            return response.json()
        if response.json()["state"] == "failed":
            raise RuntimeError(f"bootstrap failed: {response.json()['error']}")
        await asyncio.sleep(0.2)


async def one_request(
    http: httpx.AsyncClient, model: str, prompt: list[int], gen_len: int, logprobs: int | None = None
) -> Sample:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": gen_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({} if logprobs is None else {"logprobs": logprobs}),
    }
    started, ttft, tokens = time.perf_counter(), None, 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                answer = (await response.aread()).decode(errors="replace")
                return Sample(None, time.perf_counter() - started, 0, response.status_code, answer)
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # failed after the stream began
                    return Sample(ttft, time.perf_counter() - started, tokens, 200, json.dumps(chunk))
                if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    ttft = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return Sample(None, time.perf_counter() - started, 0, None, f"{type(exc).__name__}: {exc}")
    return Sample(ttft, time.perf_counter() - started, tokens, 200)


async def run_level(
    http: httpx.AsyncClient, args: argparse.Namespace, model: str, clients: int, logprobs: int | None = None
) -> dict:
    total = max(args.requests, clients)
    rng = random.Random(clients)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(total)]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    samples: list[Sample] = []

    async def client() -> None:
        while not queue.empty():
            samples.append(await one_request(http, model, queue.get_nowait(), args.gen_len, logprobs))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return {**summarize(clients, samples, time.perf_counter() - started), "logprobs": logprobs}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(round(q / 100 * (len(ordered) - 1)), len(ordered) - 1)]


def summarize(clients: int, samples: list[Sample], wall_s: float) -> dict:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft_s * 1000 for s in ok if s.ttft_s is not None]
    e2e = [s.e2e_s * 1000 for s in ok]
    failures = count_failures((s.status, s.error) for s in samples)
    return {
        "clients": clients,
        "requests": len(samples),
        "failed": failures["failed"],
        "failures": failures,
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 3),
        "output_tokens": sum(s.tokens for s in ok),
        "output_tokens_per_s": round(sum(s.tokens for s in ok) / wall_s, 1),
        "ttft_ms_p50": _round(percentile(ttft, 50)),
        "ttft_ms_p99": _round(percentile(ttft, 99)),
        "e2e_ms_p50": _round(percentile(e2e, 50)),
        "e2e_ms_p99": _round(percentile(e2e, 99)),
        "e2e_ms_mean": _round(statistics.fmean(e2e) if e2e else None),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def measure(servers: list[tuple[str, float | None, int]], args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Every level on every (server, logprobs) setting, one right after the other, ``--rounds`` times."""
    levels = [int(v) for v in args.levels.split(",")]
    limits = httpx.Limits(max_connections=max(levels) + 8, max_keepalive_connections=max(levels) + 8)
    clients = [httpx.AsyncClient(base_url=url, timeout=600, limits=limits) for url, _, _ in servers]
    try:
        ready = [await wait_ready(http) for http in clients]
        model = (await clients[0].get("/v1/models")).json()["data"][0]["id"]
        settings = [
            (http, ratio, logprobs, tp) for http, (_, ratio, tp) in zip(clients, servers) for logprobs in args.logprobs
        ]
        for http, _, logprobs, _ in settings:  # warm each path once
            await one_request(http, model, list(range(3, 3 + args.prompt_len)), args.gen_len, logprobs)
        results = []
        for round_number in range(1, args.rounds + 1):
            for level in levels:  # each setting right after the other at the same level: side by side
                order = [(i + round_number - 1) % len(settings) for i in range(len(settings))]  # who goes first rotates
                runs: list[dict] = [{}] * len(settings)
                for i in order:
                    http, ratio, logprobs, tp = settings[i]
                    runs[i] = {
                        **await run_level(http, args, model, level, logprobs),
                        "tp": tp,
                        "trace_ratio": ratio,
                        "round": round_number,
                    }
                first = runs[0]["output_tokens_per_s"] or None
                results += [
                    {**run, "vs_first": round(run["output_tokens_per_s"] / first, 3) if first else None} for run in runs
                ]
        return ready[0], results
    finally:
        for http in clients:
            await http.aclose()


def medians(levels: list[dict]) -> list[dict]:
    """Per level and setting: the median over the rounds of throughput and of ``vs_first``."""
    groups: dict[tuple, list[dict]] = {}
    for run in levels:
        groups.setdefault((run["clients"], run["tp"], run["trace_ratio"], run["logprobs"]), []).append(run)
    return [
        {
            "clients": clients,
            "tp": tp,
            "trace_ratio": ratio,
            "logprobs": logprobs,
            "rounds": len(runs),
            "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in runs),
            "vs_first": statistics.median(r["vs_first"] for r in runs if r["vs_first"] is not None)
            if any(r["vs_first"] is not None for r in runs)
            else None,
        }
        for (clients, tp, ratio, logprobs), runs in groups.items()
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url and args.trace_ratios != [None]:
        raise SystemExit("--trace-ratios starts its own servers: leave out --url")
    servers: list[Server] = []
    try:
        for tp in [] if args.url else args.tp_sizes:  # one at a time: each profiles the device alone
            for ratio in args.trace_ratios:
                servers.append(Server(args, ratio, tp))
                asyncio.run(_ready(servers[-1].url))
                servers[-1].spawn_to_ready_s = round(time.perf_counter() - servers[-1].spawned, 3)
        urls = [(args.url, None, 1)] if args.url else [(s.url, s.trace_ratio, s.tp) for s in servers]
        ready, levels = asyncio.run(measure(urls, args))
    finally:
        exit_codes = [server.stop() for server in servers]
    exit_code = exit_codes[0] if len(exit_codes) == 1 else (exit_codes or None)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "model": args.model,
        "device": args.device,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "max_batch_size": args.max_batch_size,
        "time_to_ready_s": ready["time_to_ready_s"],
        "spawn_to_ready_s": {
            f"tp{s.tp}" + ("" if s.trace is None else f" trace {s.trace_ratio}"): s.spawn_to_ready_s for s in servers
        }
        or None,
        "server_exit_code_after_sigterm": exit_code,
        "traced_requests": {str(s.trace_ratio): s.traced_requests() for s in servers if s.trace is not None} or None,
        "medians": medians(levels) if args.rounds > 1 or len(servers) > 1 else None,
        "failures": merge_failures(level["failures"] for level in levels),
        "levels": levels,
    }
    emit(result, args.out)
    return failure_exit("serve_load", result["failures"])


if __name__ == "__main__":
    sys.exit(main())
