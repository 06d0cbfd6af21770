"""The same checkpoint served and in process, side by side: what the server costs under load.

Per level of concurrent streams C (``--levels``, default 1, 16, 64, 256), C clients each send
streaming requests back to back until ``--requests-per-stream`` x C have been sent, greedy,
``ignore_eos``, ``--gen-len`` tokens each, prompts of ``--prompt-len`` random ids (the same ids
on both sides), ``logprobs`` 0 on both (so every token has a chunk of its own: the server sends
none for a token whose text is empty or held back):

- ``served``: ``bootstrap serve`` in a subprocess (the default flags, ``--no-plan-cache``),
  streaming ``/v1/completions`` over HTTP from this process;
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
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_common import count_failures, emit, failure_exit, int_list, merge_failures
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
    parser.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU, levels 1 and 4")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.smoke:
        tiny = Path(tempfile.mkdtemp()) / "tiny.json"
        tiny.write_text(json.dumps(TINY))
        args.model, args.device, args.levels = f"random:{tiny}", "cpu", [1, 4]
        args.prompt_len, args.gen_len, args.max_seq_len, args.vocab = 8, 8, 64, TINY["vocab_size"]
    if min(args.levels) < 1 or args.requests_per_stream < 1 or args.gen_len < 2:
        parser.error("--levels and --requests-per-stream take integers >= 1, --gen-len >= 2")
    args.max_batch_size = max(args.levels)
    return args


def prompts(args: argparse.Namespace, level: int) -> list[list[int]]:
    rng = random.Random(level)
    return [
        [rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(level * args.requests_per_stream)
    ]


async def clients(level: int, queue: list[list[int]], one) -> tuple[list[Stream], float]:
    """``level`` clients taking prompts from ``queue`` until it is empty; their streams and the wall time."""
    streams: list[Stream] = []

    async def client() -> None:
        while queue:
            streams.append(await one(queue.pop()))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(level)))
    return streams, time.perf_counter() - started


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


async def served(args: argparse.Namespace) -> list[dict]:
    server = Server(args)  # reads args.serve_args
    try:
        limits = httpx.Limits(max_connections=max(args.levels) + 8, max_keepalive_connections=max(args.levels) + 8)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
            await wait_ready(http)
            model = (await http.get("/v1/models")).json()["data"][0]["id"]

            async def one(prompt: list[int]) -> Stream:
                body = {
                    "model": model, "prompt": prompt, "max_tokens": args.gen_len, "temperature": 0,
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

            await one(prompts(args, 1)[0])  # the first request's compiles and allocations, on neither side's clock
            return [summary(level, *await clients(level, prompts(args, level), one)) for level in args.levels]
    finally:
        server.stop()


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
        return [summary(level, *await clients(level, prompts(args, level), one)) for level in args.levels]
    finally:
        executor.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sides = {"served": asyncio.run(served(args))}
    if args.baseline_serve_args is not None:
        baseline = argparse.Namespace(**{**vars(args), "serve_args": args.baseline_serve_args})
        sides["served_baseline"] = asyncio.run(served(baseline))
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
