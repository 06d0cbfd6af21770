"""Where a loaded server's time goes: py-spy samples of ``bootstrap serve`` under streaming load.

Starts one server (``serve_load.Server``), waits for ``/ready``, and runs ``--streams`` clients
of streaming completions (``serve_load.one_request``, back to back), split over
``--client-processes``. After ``--warmup-s`` of load it records the server's process and the
engine's (when the engine runs in one of its own) with py-spy, at once, twice, ``--duration-s`` each:

- every thread, idle ones included (``--idle``): what each thread spends its time on;
- the thread that holds the GIL only (``--gil``): how busy the GIL is, and who holds it.

Each sample is put in one category by the frames it holds (``CATEGORIES``: the engine loop's
forward, sampling, scheduling, responses, its idle wait; the event loop's HTTP, framework,
tokenizer, rendering, idle; the channel's two ends), per thread; the top leaf frames per thread
come with it. Each process's CPU cores over a record, and the clients', are measured: a client
process that uses a whole core caps what it can measure. Prints JSON and writes it to ``--out``:

    python benchmarks/serve_profile.py --model CK --device cuda --streams 64 --prompt-len 128 \
        --gen-len 128 --max-batch-size 64 --max-seq-len 1024 --vocab 120000 --out serve_profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
from bench_common import client_processes, cpu_seconds, emit, engine_pid, failure_exit
from serve_load import Sample, Server, one_request, summarize, wait_ready

# (category, a pattern one of the stack's frames must match); the first match wins, tried in order
CATEGORIES: list[tuple[str, re.Pattern]] = [
    (name, re.compile(pattern))
    for name, pattern in [
        ("idle: a socket's poll (the channel's threads)", r"poll \(zmq/sugar/poll\.py[^;]*$"),
        ("idle: the engine's stderr relay", r"_relay \(bootstrap/serve/startup/spawn\.py[^;]*$"),
        ("loop: idle (inbox wait)", r"executor/inbox\.py"),
        ("channel: rounds (encode, send)", r"_deliver \(bootstrap/engine/executor/channel/engine_side\.py"),
        ("channel: receive (decode, route)", r"executor/channel/(client|threads|messages)\.py"),
        ("loop: detokenize", r"\b(add|_decode|flush) \(bootstrap/engine/request/sequence\.py"),
        ("loop: sampling (incl. the host sync)", r"engine/sampling/|_sample \(bootstrap/engine/executor/loop\.py"),
        ("loop: speculation", r"engine/spec/"),
        ("loop: forward (inputs, graph replay, kernels)", r"engine/step/|engine/layers/|engine/models/"),
        ("loop: scheduling", r"engine/scheduler\.py|engine/kv_cache/"),
        ("loop: responses (append, stops, wake waiters)", r"executor/(responses|request_table)\.py"),
        ("tokenize", r"\bencode \(|apply_chat_template"),
        ("render (chunks, JSON)", r"serve/openai/(render|choices|logprobs|jobs)\.py|json/encoder\.py"),
        ("HTTP (uvicorn, h11, httptools)", r"uvicorn/|h11/|httptools"),
        ("framework (starlette, fastapi, pydantic)", r"starlette/|fastapi/|pydantic"),
        ("idle: event loop (select)", r"select \(selectors\.py"),
        ("idle: a pool thread's wait", r"_worker \(concurrent/futures/thread\.py|wait \(threading\.py"),
    ]
]

MODES = ("--idle", "--gil")  # every thread, idle ones included; the GIL's holder only


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152, help="prompt token ids are drawn below this")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="load before the first record")
    parser.add_argument("--duration-s", type=float, default=10.0, help="each record's length")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--serve-args", default="", help="more flags for bootstrap serve, one string")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=client_processes(),
        help="processes the streams are split over (default: a quarter of the cores, at most 4)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if shutil.which("py-spy") is None:
        parser.error("py-spy is not on PATH (pip install py-spy)")
    return args


def category(stack: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.search(stack):
            return name
    return "other"


def read_raw(path: Path) -> list[tuple[str, str, str, int]]:
    """py-spy's raw (collapsed) stacks as (thread id, thread name, stack, samples)."""
    rows = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread, _, frames = stack.partition(";")
        found = re.match(r"thread \((\w+)\):? ?(.*)", thread)
        tid, name = (found.group(1), found.group(2) or "unnamed") if found else ("?", thread)
        rows.append((tid, name, frames, int(count)))
    return rows


def breakdown(rows: list[tuple[str, str, str, int]], expected: int) -> dict:
    """Per thread name (threads of one name summed): its samples, their share of ``expected``
    (rate x duration), per category and the top leaf frames."""
    threads: dict[str, Counter] = {}
    leaves: dict[str, Counter] = {}
    ids: dict[str, set[str]] = {}
    for tid, name, frames, count in rows:
        threads.setdefault(name, Counter())[category(frames)] += count
        leaves.setdefault(name, Counter())[frames.rsplit(";", 1)[-1]] += count
        ids.setdefault(name, set()).add(tid)
    return {
        name: {
            "threads": len(ids[name]),
            "samples": sum(counts.values()),
            "share_of_window": round(sum(counts.values()) / expected, 3),
            "categories": {k: round(v / expected, 3) for k, v in counts.most_common()},
            "top_leaves": {k: round(v / expected, 3) for k, v in leaves[name].most_common(12)},
        }
        for name, counts in sorted(threads.items(), key=lambda item: -sum(item[1].values()))
    }


async def record(pids: dict[str, int], args: argparse.Namespace, mode: str, folder: Path) -> dict:
    """One py-spy record (``mode``: ``--idle`` or ``--gil``) of each of ``pids`` at once, and their CPU figures."""
    before, wall = {name: cpu_seconds(pid) for name, pid in pids.items()}, time.perf_counter()
    outs = {name: folder / f"py-spy-{name}{mode[1:]}.txt" for name in pids}
    spies = {}
    for name, pid in pids.items():
        spies[name] = await asyncio.create_subprocess_exec(
            "py-spy", "record", "--pid", str(pid), "--threads", mode, "--format", "raw", "--rate", str(args.rate),
            "--duration", str(int(args.duration_s)), "--nonblocking", "-o", str(outs[name]),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    for name, spy in spies.items():
        _, err = await spy.communicate()
        if spy.returncode != 0:
            message = err.decode(errors="replace").strip()[-300:]
            raise RuntimeError(f"py-spy {mode} of the {name} exited {spy.returncode}: {message}")
    wall = time.perf_counter() - wall
    expected = max(1, round(args.rate * args.duration_s))
    processes = {}
    for name, pid in pids.items():
        rows = read_raw(outs[name])
        processes[name] = {
            "cpu_cores": round((cpu_seconds(pid) - before[name]) / wall, 2),
            "samples": sum(row[-1] for row in rows),
            "threads": breakdown(rows, expected),
        }
    return {"mode": mode, "wall_s": round(wall, 2), "expected_samples_per_thread": expected, "processes": processes}


def load_part(url: str, model: str, streams: int, args: argparse.Namespace, seed: int, until: float) -> dict:
    """In a client process: ``streams`` clients sending back to back until ``until`` (``perf_counter``)."""

    async def run() -> dict:
        limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
        rng, samples = random.Random(seed), []

        async def client(http: httpx.AsyncClient) -> None:
            while time.perf_counter() < until:
                prompt = [rng.randrange(3, args.vocab) for _ in range(args.prompt_len)]
                samples.append(await one_request(http, model, prompt, args.gen_len))

        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            cpu, started = time.process_time(), time.perf_counter()
            await asyncio.gather(*(client(http) for _ in range(streams)))
            return {"samples": samples, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - started}

    return asyncio.run(run())


async def profile(server: Server, args: argparse.Namespace, folder: Path) -> tuple[dict, list[dict]]:
    """The records while ``--streams`` clients (over ``--client-processes``) send back to back."""
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:
        await wait_ready(http)
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
    pids = {"server": server.proc.pid}
    engine = engine_pid(server.proc.pid)
    if engine is not None:
        pids["engine"] = engine
    parts = min(args.client_processes, args.streams)
    until = time.perf_counter() + args.warmup_s + 2 * args.duration_s + 10  # the records' py-spy start included
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(parts, mp_context=multiprocessing.get_context("spawn")) as pool:
        started = time.perf_counter()
        load = [
            loop.run_in_executor(pool, load_part, server.url, model, len(range(i, args.streams, parts)), args, i, until)
            for i in range(parts)
        ]
        await asyncio.sleep(args.warmup_s)
        records = [await record(pids, args, mode, folder) for mode in MODES]
        done = await asyncio.gather(*load)
    wall = time.perf_counter() - started
    samples: list[Sample] = [sample for part in done for sample in part["samples"]]
    level = summarize(args.streams, samples, wall)
    level["client_cpu_cores"] = round(sum(part["cpu_s"] for part in done) / wall, 2)
    return level, records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = Path(args.out).parent if args.out else Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    server = Server(args)
    try:
        level, records = asyncio.run(profile(server, args, folder))
    finally:
        exit_code = server.stop()
    result = {
        "benchmark": "serve_profile",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "cpus": os.cpu_count(),
        "model": args.model,
        "device": args.device,
        "streams": args.streams,
        "server_exit_code_after_sigterm": exit_code,
        "load": level,
        "records": records,
        "failures": level["failures"],
    }
    emit(result, args.out)
    return failure_exit("serve_profile", result["failures"])


if __name__ == "__main__":
    sys.exit(main())
