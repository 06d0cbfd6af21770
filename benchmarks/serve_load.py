"""``bootstrap serve`` under load: requests/s, time to first token and end-to-end latency.

Starts the server in a subprocess (or uses ``--url``), waits for ``/ready``, then for each
concurrency level C runs C clients at once, each sending streaming ``/v1/completions`` requests
back to back until ``--requests`` (per level) have been sent. Prompts are random token ids
(the text each token adds is what arrives; a model needs a tokenizer for TTFT), greedy, ``max_tokens`` = ``--gen-len``.

Per level: ``requests_per_s`` (completed / wall time), ``output_tokens_per_s``, TTFT (request
sent to first text chunk) and end-to-end (request sent to ``[DONE]``) p50 and p99 in ms, and
the number of failed requests. The clients run in this process on the same machine as the
server: on a small CPU they share its cores. Prints JSON and writes it to ``--out``.

``--logprobs off,5`` measures each level once per setting (``off``: none asked; K: ``logprobs``
K on every request), on the same server, one right after the other, and adds each setting's
throughput as a ratio to the first one's (``vs_first``): the feature's cost, side by side.

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
STARTED = re.compile(r"Uvicorn running on (http://[\d.]+:\d+)")


@dataclass
class Sample:
    ttft_s: float | None
    e2e_s: float
    tokens: int
    ok: bool


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
    parser.add_argument("--logprobs", default="off", type=_logprobs_settings,
                        help="comma-separated settings measured side by side: off, or K (0-20) logprobs per token")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def _logprobs_settings(text: str) -> list[int | None]:
    settings = [None if v.strip() == "off" else int(v) for v in text.split(",")]
    if any(v is not None and not 0 <= v <= 20 for v in settings):
        raise argparse.ArgumentTypeError(f"--logprobs: off or 0-20 each, got {text!r}")
    return settings


class Server:
    """``bootstrap serve`` in a subprocess on a free port; SIGTERM on exit."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        command = [sys.executable, "-m", "bootstrap.cli", "serve", "--model", args.model, "--device", args.device,
                   "--port", "0", "--max-batch-size", str(args.max_batch_size), "--max-seq-len", str(args.max_seq_len),
                   "--no-plan-cache"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = self._port()

    def _port(self) -> str:
        while self.proc.poll() is None:
            found = STARTED.search(Path(self.log.name).read_text())
            if found:
                return found.group(1)
            time.sleep(0.05)
        raise RuntimeError(f"bootstrap serve exited:\n{Path(self.log.name).read_text()}")

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


async def wait_ready(http: httpx.AsyncClient) -> dict:
    while True:
        response = await http.get("/ready")
        if response.status_code == 200:
            return response.json()
        if response.json()["state"] == "failed":
            raise RuntimeError(f"bootstrap failed: {response.json()['error']}")
        await asyncio.sleep(0.2)


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], gen_len: int,
                      logprobs: int | None = None) -> Sample:  # fmt: skip
    body = {"model": model, "prompt": prompt, "max_tokens": gen_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({} if logprobs is None else {"logprobs": logprobs})}  # fmt: skip
    started, ttft, tokens = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Sample(None, time.perf_counter() - started, 0, False)
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return Sample(ttft, time.perf_counter() - started, tokens, True)


async def run_level(http: httpx.AsyncClient, args: argparse.Namespace, model: str, clients: int,
                    logprobs: int | None = None) -> dict:  # fmt: skip
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
    return ordered[min(int(round(q / 100 * (len(ordered) - 1))), len(ordered) - 1)]


def summarize(clients: int, samples: list[Sample], wall_s: float) -> dict:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft_s * 1000 for s in ok if s.ttft_s is not None]
    e2e = [s.e2e_s * 1000 for s in ok]
    return {
        "clients": clients,
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 3),
        "output_tokens_per_s": round(sum(s.tokens for s in ok) / wall_s, 1),
        "ttft_ms_p50": _round(percentile(ttft, 50)),
        "ttft_ms_p99": _round(percentile(ttft, 99)),
        "e2e_ms_p50": _round(percentile(e2e, 50)),
        "e2e_ms_p99": _round(percentile(e2e, 99)),
        "e2e_ms_mean": _round(statistics.fmean(e2e) if e2e else None),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def measure(url: str, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    levels = [int(v) for v in args.levels.split(",")]
    limits = httpx.Limits(max_connections=max(levels) + 8, max_keepalive_connections=max(levels) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        ready = await wait_ready(http)
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for logprobs in args.logprobs:  # warm each path once
            await one_request(http, model, list(range(3, 3 + args.prompt_len)), args.gen_len, logprobs)
        results = []
        for clients in levels:  # each setting right after the other at the same level: side by side
            runs = [await run_level(http, args, model, clients, logprobs) for logprobs in args.logprobs]
            first = runs[0]["output_tokens_per_s"] or None
            results += [{**run, "vs_first": round(run["output_tokens_per_s"] / first, 3) if first else None}
                        for run in runs]  # fmt: skip
        return ready, results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None if args.url else Server(args)
    try:
        ready, levels = asyncio.run(measure(args.url or server.url, args))
    finally:
        exit_code = server.stop() if server is not None else None
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "environment": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                        "platform": platform.platform()},  # fmt: skip
        "model": args.model, "device": args.device, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "max_batch_size": args.max_batch_size, "time_to_ready_s": ready["time_to_ready_s"],
        "server_exit_code_after_sigterm": exit_code,
        "levels": levels,
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
