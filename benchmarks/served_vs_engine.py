"""The same checkpoint served and in process, side by side: what the server costs under load.

Per level of concurrent streams C (``--levels``, default 1, 16, 64, 256), C clients each send
streaming requests back to back until ``--requests-per-stream`` x C have been sent, greedy,
``ignore_eos``, ``--gen-len`` tokens each, prompts of ``--prompt-len`` random ids (the same ids
on both sides), ``logprobs`` 0 on both (so every token has a chunk of its own: the server sends
none for a token whose text is empty or held back):

- ``served``: ``bootstrap serve`` in a subprocess (the default flags, ``--no-plan-cache``),
  streaming ``/v1/completions`` over HTTP, the streams split over ``--client-processes``
  processes (their CPU per second of the level: ``client_cpu_cores``; the server's process's CPU
  per token: ``server_cpu_us_per_token``);
- ``in_process``: the executor ``build_executor`` makes from the same config in this process,
  after the server has exited, streamed with ``stream_async`` (no HTTP, no tokenizer).

Per side and level: output tok/s, TTFT p50/p99 (request sent to its first token's chunk, whatever
its text) and inter-token latency p50/p99 (the gaps between a request's chunks: a chunk is one
token); ``served_over_in_process`` is the ratio of output tok/s, side by side in one run
(``--baseline-serve-args``: a third side, ``served_baseline``, served with other flags). A
request that fails is counted (status, first error line) and the script exits 1. ``--smoke``: a
tiny random model on the CPU, levels 1 and 4, for the suite. Prints JSON, writes ``--out``:

    python benchmarks/served_vs_engine.py --model CK --device cuda --max-seq-len 1024 --vocab 120000 --out sve.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_common import client_processes, count_failures, cpu_seconds, emit, failure_exit, int_list, merge_failures
from serve_load import Server, percentile, wait_ready

TINY = {
    "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "torch_dtype": "float32",
}  # fmt: skip


@dataclass
class Stream:
    """One request as its client saw it: when it was sent and when each token's chunk came."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    status: int | str | None = 200
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--levels", type=int_list, default=[1, 16, 64, 256], help="concurrent streams, e.g. 1,16")
    parser.add_argument("--requests-per-stream", type=int, default=2, help="requests each client sends")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below this")
    parser.add_argument("--serve-args", default="", help="more flags for bootstrap serve, one string")
    parser.add_argument(
        "--baseline-serve-args",
        default=None,
        help="also serve with these flags instead (a side of its own, 'served_baseline', in the same run; "
        "e.g. --engine-in-process: the server without the engine's process)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=client_processes(),
        help="processes the served side's streams are split over (default: a quarter of the cores, at most 4): "
        "a single Python client's parsing can cap what it measures (client_cpu_cores shows it)",
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU, levels 1 and 4")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.smoke:
        tiny = Path(tempfile.mkdtemp()) / "tiny.json"
        tiny.write_text(json.dumps(TINY))
        args.model, args.device, args.levels = f"random:{tiny}", "cpu", [1, 4]
        args.prompt_len, args.gen_len, args.max_seq_len, args.vocab = 8, 8, 64, TINY["vocab_size"]
    if min(args.levels) < 1 or args.requests_per_stream < 1 or args.gen_len < 2 or args.client_processes < 1:
        parser.error("--levels, --requests-per-stream and --client-processes take integers >= 1, --gen-len >= 2")
    args.max_batch_size = max(args.levels)
    return args


def prompts(args: argparse.Namespace, level: int) -> list[list[int]]:
    rng = random.Random(level)
    return [
        [rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(level * args.requests_per_stream)
    ]


async def clients(level: int, queue: list[list[int]], one) -> list[Stream]:
    """``level`` clients taking prompts from ``queue`` until it is empty; their streams."""
    streams: list[Stream] = []

    async def client() -> None:
        while queue:
            streams.append(await one(queue.pop()))

    await asyncio.gather(*(client() for _ in range(level)))
    return streams


def span_s(streams: list[Stream]) -> float:
    """From the first request sent to the last chunk received."""
    return max(max([s.sent, *s.chunks]) for s in streams) - min(s.sent for s in streams)


def summary(level: int, streams: list[Stream], wall_s: float) -> dict:
    ok = [s for s in streams if s.error is None]
    ttft = [(s.chunks[0] - s.sent) * 1000 for s in ok if s.chunks]
    gaps = [(b - a) * 1000 for s in ok for a, b in zip(s.chunks, s.chunks[1:])]
    tokens = sum(len(s.chunks) for s in ok)
    return {
        "streams": level,
        "requests": len(streams),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall_s, 1),
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "itl_ms_p50": _ms(percentile(gaps, 50)),
        "itl_ms_p99": _ms(percentile(gaps, 99)),
        "failures": count_failures((s.status, s.error) for s in streams),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


async def served_one(http: httpx.AsyncClient, model: str, prompt: list[int], gen_len: int) -> Stream:
    """One streaming completion over HTTP, each token's chunk timed as it arrives."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": gen_len, "temperature": 0,
        "ignore_eos": True, "stream": True, "logprobs": 0,
    }  # fmt: skip
    stream = Stream(time.perf_counter())
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                stream.status, stream.error = response.status_code, (await response.aread()).decode()
                return stream
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        stream.error = json.dumps(chunk)
                        return stream
                    token = chunk["choices"] and chunk["choices"][0].get("logprobs")  # not the finish
                    if token:
                        stream.chunks.append(time.perf_counter())
    except httpx.HTTPError as exc:
        stream.status, stream.error = None, f"{type(exc).__name__}: {exc}"
    return stream


def client_part(url: str, model: str, level: int, queue: list[list[int]], gen_len: int) -> tuple[list[Stream], float]:
    """In a client process: ``level`` streams over ``queue``; their streams and this process's CPU seconds."""

    async def run() -> tuple[list[Stream], float]:
        limits = httpx.Limits(max_connections=level + 8, max_keepalive_connections=level + 8)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            cpu = time.process_time()  # the client's set-up (its TLS context) is not the load's
            streams = await clients(level, queue, lambda prompt: served_one(http, model, prompt, gen_len))
            return streams, time.process_time() - cpu

    return asyncio.run(run())


def _spawned(_: int) -> int:
    time.sleep(0.5)  # held, so that each of the pool's processes takes one and all of them start
    return os.getpid()


def served_level(pool: ProcessPoolExecutor | None, server: Server, model: str, level: int, args) -> dict:
    """One level's streams split over the client processes (in this one without a ``pool``); wall
    time from the first request sent to the last chunk (``perf_counter``: one clock for all on Linux);
    the server's process's CPU time per token (the engine's process, when it has one, not counted)."""
    queue, parts, url = prompts(args, level), min(args.client_processes, level), server.url
    server_cpu = cpu_seconds(server.proc.pid)
    part_args = [(url, model, len(range(i, level, parts)), queue[i::parts], args.gen_len) for i in range(parts)]
    if pool is None:
        results = [client_part(*part) for part in part_args]
    else:
        results = [future.result() for future in [pool.submit(client_part, *part) for part in part_args]]
    streams = [stream for part, _ in results for stream in part]
    wall_s = span_s(streams)
    figures = summary(level, streams, wall_s)
    figures["client_cpu_cores"] = round(sum(cpu for _, cpu in results) / wall_s, 2)
    server_cpu, tokens = cpu_seconds(server.proc.pid) - server_cpu, figures["output_tokens"]
    figures["server_cpu_us_per_token"] = round(server_cpu / tokens * 1e6, 1) if tokens else None
    return figures


def served(args: argparse.Namespace) -> list[dict]:
    server = Server(args)  # reads args.serve_args
    processes = min(args.client_processes, max(args.levels))
    try:
        with contextlib.ExitStack() as stack:
            pool = None
            if processes > 1:
                spawn = multiprocessing.get_context("spawn")
                pool = stack.enter_context(ProcessPoolExecutor(processes, mp_context=spawn))
                list(pool.map(_spawned, range(processes)))
            model = asyncio.run(ready_model(server.url))
            client_part(server.url, model, 1, prompts(args, 1)[:1], args.gen_len)  # compiles, allocations: unclocked
            return [served_level(pool, server, model, level, args) for level in args.levels]
    finally:
        server.stop()


async def ready_model(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await wait_ready(http)
        return (await http.get("/v1/models")).json()["data"][0]["id"]


async def in_process(args: argparse.Namespace) -> list[dict]:
    from bootstrap.api import build_executor
    from bootstrap.config import BootstrapConfig
    from bootstrap.engine import SamplingParams

    config = BootstrapConfig.parse(
        model=args.model, device=args.device, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len
    )
    executor, _ = await build_executor(config)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0, ignore_eos=True, logprobs=0)

    async def one(prompt: list[int]) -> Stream:
        stream = Stream(time.perf_counter())
        try:
            async for event in executor.stream_async(executor.enqueue(prompt, params)):
                stream.chunks.append(time.perf_counter())
                if event.error:
                    stream.status, stream.error = "error", event.error
        except Exception as exc:
            stream.status, stream.error = None, f"{type(exc).__name__}: {exc}"
        return stream

    try:
        await one(prompts(args, 1)[0])
        levels = [(level, await clients(level, prompts(args, level), one)) for level in args.levels]
        return [summary(level, streams, span_s(streams)) for level, streams in levels]
    finally:
        executor.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sides = {"served": served(args)}
    if args.baseline_serve_args is not None:
        baseline = argparse.Namespace(**{**vars(args), "serve_args": args.baseline_serve_args})
        sides["served_baseline"] = served(baseline)
    sides["in_process"] = asyncio.run(in_process(args))
    levels = []
    for i, level in enumerate(args.levels):
        row: dict = {"streams": level, **{name: side[i] for name, side in sides.items()}}
        tok_s = row["in_process"]["output_tok_s"]
        for name in sides.keys() - {"in_process"}:
            row[f"{name}_over_in_process"] = round(row[name]["output_tok_s"] / tok_s, 3) if tok_s else None
        levels.append(row)
    result = {
        "benchmark": "served_vs_engine",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model,
        "device": args.device,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "levels": levels,
        "serve_args": args.serve_args,
        "baseline_serve_args": args.baseline_serve_args,
        "failures": merge_failures(row[key]["failures"] for row in levels for key in sides),
    }
    emit(result, args.out)
    return failure_exit("served_vs_engine", result["failures"])


if __name__ == "__main__":
    sys.exit(main())
