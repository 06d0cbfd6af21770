"""Automatic prefix caching as a client meets it: N streamed chat completions sent at once, all
sharing one system prompt, on a fresh ``bootstrap serve`` with the cache on (the default) and on
one with ``--no-prefix-cache``, in one run.

Each server (one at a time, default flags plus the preset's, one plan cache and Triton/inductor
caches the run owns: the second start finds the first one's plan and kernels) gets one warm-up
request with the system prompt and a question of its own (the "on" server then holds the prompt's
blocks, as a server in steady state would; the "off" server gets the same request), then N
requests at once: the system message of about L words, a distinct question of about Q words,
greedy, ``max_tokens`` fixed, ``ignore_eos`` (every answer is ``max_tokens`` long). Per request:
time to first token (send to the first content chunk), end, prompt and cached tokens from the
usage chunk. Per server: TTFT p50/p99, wall time, requests/s and output tokens/s, the
``/metrics`` prefix-cache counters before and after. Then the ratios (off over on for TTFT, on
over off for throughput) and whether the greedy answers are equal. Words are ones the tokenizer
keeps as single tokens (common English words; ``wN`` for the word-level tokenizer of a written
checkpoint), so L and Q are about tokens; ``usage.prompt_tokens`` gives the exact counts. A request
that fails (refused, an error in its stream, no content) counts in ``failures`` and in none of the
figures; then the exit status is 1, with one line on stderr naming the HTTP status, the JSON written.

    python benchmarks/prefix_cache.py --preset cpu --out benchmarks/results/prefix_cache_cpu_smollm2.json
    python benchmarks/prefix_cache.py --preset 8b --out prefix_cache_h200.json
    python benchmarks/prefix_cache.py --preset tiny --out /tmp/prefix_cache_tiny.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # bench_common, cold_start and live_ops, also when loaded by path
from bench_common import (  # noqa: E402
    count_failures,
    failure_exit,
    merge_failures,
    ratio,
    report_header,
    resolve_device,
    save,
    server_env,
)
from cold_start import write_checkpoint  # noqa: E402
from live_ops import call, free_port, metrics  # noqa: E402

MODEL_ID = "prefix-cache"  # --served-model-name of both servers
DEFAULT_MAX_BATCH = 32  # bootstrap serve's --max-batch-size default: more requests raise it to N
TINY = {
    **{"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64},
    **{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    **{"max_position_embeddings": 512, "torch_dtype": "float32"},
}
# the written checkpoints' word-level tokenizer has no chat template: the messages' words, in order
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
PRESETS: dict[str, dict[str, Any]] = {
    # SmolLM2 on 2 CPU cores: the H200's prompt shape, a quarter of the requests, short answers (~2.5 min)
    "cpu": {"model": "smollm2-135m-instruct", "device": "cpu", "n": 16, "l": 2000, "q": 50, "max_tokens": 16},
    # an 8B llama checkpoint written here (bfloat16, random weights, word-level tokenizer)
    "8b": {"shape": "llama-3.1-8b", "device": "cuda", "n": 64, "l": 2000, "q": 50, "max_tokens": 64},
    # a tiny llama checkpoint on the CPU: the script itself, in seconds
    "tiny": {"shape": "tiny", "device": "cpu", "n": 4, "l": 96, "q": 8, "max_tokens": 4},
}
TARGETS = {"8b": {"ttft_p50_off_over_on": 5.0, "throughput_on_over_off": 2.0}}
# common English words that SmolLM2's (and most BPE) tokenizers keep as one token after a space
ENGLISH_TEXT = """the of and to in is that for it as with was on be by at this are from or have an they which one you
were all we her she there been his has when who will more no if out so said what up its about into than them can only
other new some could time these two may then do first any my now such like our over man me even most made after also
did many before must through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right used take three small states
himself few house use during without again place around however home found thought went say part once general high
upon school every does got united left number course war until always away something fact though water less public
put think almost hand enough far took head yet government system better set told nothing night end why called find
look asked later knew point next program city business give group toward young days let room president side social
given present several order national second possible rather per face among form important often things looked early
white case john become large big need four within felt along children saw best church ever least power development
light thing seemed family interest want members mind country area others done turned although open god service
certain kind problem began different door thus help sense means whole matter perhaps itself times law human line above
name example action company hands local show whether five history gave today either act feet across taken past quite
anything seen having death week experience body word half really field am car words already themselves information
tell together college shall money period held keep sure free real seems behind cannot miss political air question
making office brought whose special"""
ENGLISH = ENGLISH_TEXT.split()
PREFIX_METRICS = (
    "bootstrap_prefix_caching",
    "bootstrap_prefix_cache_query_tokens_total",
    "bootstrap_prefix_cache_hit_tokens_total",
    "bootstrap_kv_cached_blocks",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--preset", choices=sorted(PRESETS), default="cpu", help="cpu: SmolLM2; 8b: an 8B checkpoint on CUDA; tiny")
    add("--model", help="serve this model instead of the preset's (no checkpoint written)")
    add("--device", help="the servers' --device (default: the preset's)")
    add("--requests", "-n", type=int, help="N: requests sent at once")
    add("--system-tokens", "-l", type=int, help="L: words (about tokens) of the shared system prompt")
    add("--question-tokens", "-q", type=int, help="Q: words (about tokens) of each distinct question")
    add("--max-tokens", type=int, help="tokens generated per request (ignore_eos: exactly these)")
    add("--words", choices=("english", "ids"), help="english words, or wN (word-level tokenizer; default: preset's)")
    add("--first", choices=("on", "off"), default="on", help="which server starts and is measured first")
    add("--serve-args", default="", help="more flags for both servers, one string")
    add("--work-dir", type=Path, help="checkpoint, caches and logs (default: a new directory under /tmp)")
    add("--keep", action="store_true", help="keep what this run wrote in the work dir (a checkpoint is reused)")
    add("--out", type=Path, help="the JSON (default: benchmarks/results/prefix_cache_<preset>.json)")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    args.device = args.device or preset["device"]
    args.requests = args.requests or preset["n"]
    args.system_tokens = args.system_tokens or preset["l"]
    args.question_tokens = args.question_tokens or preset["q"]
    args.max_tokens = args.max_tokens or preset["max_tokens"]
    args.words = args.words or ("english" if args.model or "model" in preset else "ids")
    args.out = args.out or HERE / "results" / f"prefix_cache_{args.preset}.json"
    return args


# ---- the model and the prompts --------------------------------------------------------------------


def model_path(args: argparse.Namespace, work: Path) -> tuple[str, dict[str, Any] | None]:
    """The model both servers serve: ``--model``, the preset's named model, or a checkpoint written
    under ``work`` (with a chat template added to its word-level tokenizer)."""
    preset = PRESETS[args.preset]
    if args.model or "model" in preset:
        return args.model or preset["model"], None
    shape, path = preset["shape"], work / "checkpoint"
    if shape == "tiny":
        shape = str(work / "tiny.json")
        Path(shape).write_text(json.dumps(TINY))
    elif not (path / "config.json").is_file() and (free := shutil.disk_usage(work).free) < 20e9:
        raise SystemExit(f"prefix_cache: {free / 1e9:.1f} GB free under {work}; the 8B checkpoint needs ~16 GB")
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    written = write_checkpoint(SimpleNamespace(shape=shape, device=device), path, words=None)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return str(path), {"shape": preset["shape"], **written}


def vocabulary(args: argparse.Namespace, model: str) -> list[str]:
    """Words one token each: common English words, or ``w3`` .. of a word-level tokenizer (its
    vocab size from the checkpoint's config; w0..w2 are unk, bos and eos)."""
    if args.words == "english":
        return ENGLISH
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    return [f"w{i}" for i in range(3, vocab_size)]


def prompts(words: list[str], n: int, system_words: int, question_words: int) -> tuple[str, list[str], str]:
    """The shared system prompt, N distinct questions and the warm-up's question (seeded: both
    servers get the same texts)."""
    system = " ".join(random.Random(0).choices(words, k=system_words))
    questions: list[str] = []
    for i in range(n + 1):
        rng = random.Random(1000 + i)
        question = " ".join(rng.choices(words, k=question_words))
        while question in questions:
            question = " ".join(rng.choices(words, k=question_words))
        questions.append(question)
    return system, questions[1:], questions[0]


# ---- a server -------------------------------------------------------------------------------------


class Server:
    """``bootstrap serve`` in a subprocess on a free port, its output in a log file under ``work``."""

    def __init__(self, args: argparse.Namespace, work: Path, model: str, arm: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"serve-{arm}.log"
        env = server_env(work / "caches")
        batch = ["--max-batch-size", str(args.requests)] if args.requests > DEFAULT_MAX_BATCH else []
        command = [
            *("-m", "bootstrap.cli", "serve", "--model", model, "--device", args.device),
            *("--port", str(self.port), "--plan-cache", str(work / "caches" / "plans")),
            *("--served-model-name", MODEL_ID, *batch, *shlex.split(args.serve_args)),
            *(["--no-prefix-cache"] if arm == "off" else []),
        ]
        self.command = " ".join(["bootstrap", *command[2:]])
        with self.log_path.open("w") as log:
            self.t0 = time.perf_counter()
            self.proc = subprocess.Popen([sys.executable, *command], env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 900.0) -> dict[str, Any]:
        """Spawn to ``/ready`` 200; the server's time to ready and whether its plan was cached."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                status, body = call(f"{self.url}/ready", timeout=5)
            except OSError:
                time.sleep(0.1)
                continue
            if status == 200:
                _, view = call(f"{self.url}/v1/bootstrap")
                profiling = next((s for s in view["stages"] if s["id"] == "profiling"), {})
                return {
                    "spawn_to_ready_s": round(time.perf_counter() - self.t0, 3),
                    "time_to_ready_s": view.get("time_to_ready_s"),
                    "plan_cached": profiling.get("skip_reason") == "plan-cache",
                    "kv_tokens": (view.get("plan") or {}).get("kv_tokens"),
                    "max_batch_size": (view.get("plan") or {}).get("max_batch_size"),
                }
            if isinstance(body, dict) and body.get("state") == "failed":
                raise RuntimeError(f"the server failed: {body.get('error')}\n{self.log_tail()}")
            time.sleep(0.2)
        raise RuntimeError(f"the server never became ready\n{self.log_tail()}")

    def stop(self, timeout: float = 120.0) -> int:
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def prefix_metrics(url: str) -> dict[str, int | None]:
    """The prefix-cache samples of ``/metrics`` (None: the server does not export it)."""
    samples = metrics(url)
    return {name: None if samples.get(name) is None else int(samples[name]) for name in PREFIX_METRICS}


# ---- the client -----------------------------------------------------------------------------------


async def chat(http: httpx.AsyncClient, system: str, question: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat completion: TTFT and end from the send, the text, the usage."""
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    parts: list[str] = []  # the streamed content chunks: a token each (detokenizing may hold one back)
    row: dict[str, Any] = {"sent": sent, "ttft_s": None, "chunks": parts, "usage": None, "status": None, "error": None}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            row["status"] = response.status_code
            if response.status_code != 200:
                row["error"] = (await response.aread()).decode(errors="replace")[:300]
            else:
                await _read_stream(response, row, sent)
    except httpx.HTTPError as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    if row["error"] is None and row["ttft_s"] is None:
        row["error"] = "the stream ended without content"
    row["end"], row["text"] = time.perf_counter(), "".join(parts)
    return row


async def _read_stream(response: httpx.Response, row: dict[str, Any], sent: float) -> None:
    """The content chunks into ``row["chunks"]`` (TTFT at the first), the usage, an error chunk's text."""
    async for line in response.aiter_lines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            row["error"] = json.dumps(chunk)[:300]
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                if row["ttft_s"] is None:
                    row["ttft_s"] = time.perf_counter() - sent
                row["chunks"].append(content)
        row["usage"] = chunk.get("usage") or row["usage"]


async def load(url: str, system: str, questions: list[str], warmup: str, max_tokens: int) -> dict[str, Any]:
    """The warm-up request, the prefix counters, all the requests at once, the counters again."""
    limits = httpx.Limits(max_connections=len(questions) + 8, max_keepalive_connections=len(questions) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        warm = await chat(http, system, warmup, max_tokens)
        before = await asyncio.to_thread(prefix_metrics, url)
        rows = await asyncio.gather(*(chat(http, system, q, max_tokens) for q in questions))
        after = await asyncio.to_thread(prefix_metrics, url)
    return {"warmup": warm, "rows": rows, "metrics_before": before, "metrics_after": after}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank on the sorted values (serve_load's rule)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(round(q / 100 * (len(ordered) - 1)), len(ordered) - 1)]


def _cached(usage: dict[str, Any] | None) -> int | None:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    """One server's figures from its requests (``rows``), its warm-up and its counters; the failed
    requests (the warm-up's too) counted, none of the figures taken from them."""
    rows = measured["rows"]
    ok = [r for r in rows if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["end"] - r["sent"] for r in ok]
    wall = max(r["end"] for r in rows) - min(r["sent"] for r in rows)
    output_tokens = sum((r["usage"] or {}).get("completion_tokens", 0) for r in ok)
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in ok if r["usage"]]
    cached = [_cached(r["usage"]) for r in ok]
    before, after = measured["metrics_before"], measured["metrics_after"]
    delta = {
        name.removeprefix("bootstrap_prefix_cache_").removesuffix("_total"): (
            None if before.get(name) is None or after.get(name) is None else after[name] - before[name]
        )
        for name in PREFIX_METRICS[1:3]
    }
    warm = measured["warmup"]
    return {
        "requests": len(rows),
        "answered": len(ok),
        "errors": [r["error"] for r in rows if r["error"] is not None][:5],
        "failures": count_failures((r["status"], r["error"]) for r in [measured["warmup"], *rows]),
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "ttft_ms_min": _ms(min(ttft, default=None)),
        "ttft_ms_max": _ms(max(ttft, default=None)),
        "e2e_ms_p50": _ms(percentile(e2e, 50)),
        "e2e_ms_p99": _ms(percentile(e2e, 99)),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / wall, 1),
        "prompt_tokens": {"min": min(prompt_tokens), "max": max(prompt_tokens)} if prompt_tokens else None,
        "cached_tokens": cached if any(c is not None for c in cached) else None,
        "warmup": {
            "ttft_ms": _ms(warm["ttft_s"]),
            "e2e_ms": _ms(None if warm["end"] is None else warm["end"] - warm["sent"]),
            "prompt_tokens": (warm["usage"] or {}).get("prompt_tokens"),
            "cached_tokens": _cached(warm["usage"]),
            "error": warm["error"],
        },
        "metrics_before": before,
        "metrics_after": after,
        "metrics_delta": delta,
        "hit_rate": ratio(delta["hit_tokens"], delta["query_tokens"]),
    }


def compare(on: list[dict[str, Any]], off: list[dict[str, Any]]) -> dict[str, Any]:
    """The greedy answers request by request: equal, how many differ, the first few that do, and
    where they part (``agreeing_chunks``: the streamed chunks, about tokens, equal from the start)."""
    differing = [i for i, (a, b) in enumerate(zip(on, off)) if a["text"] != b["text"] or a["error"] or b["error"]]
    agreeing = [_common(a["chunks"], b["chunks"]) for a, b in zip(on, off)]
    samples = [
        {"request": i, "agreeing_chunks": agreeing[i], "on": on[i]["text"][:200], "off": off[i]["text"][:200]}
        for i in differing[:3]
    ]
    return {
        "compared": len(on),
        "equal": not differing,
        "differing": len(differing),
        "same_first_chunk": sum(n > 0 for n in agreeing),
        "agreeing_chunks_min": min(agreeing, default=None),
        "samples": samples,
    }


def _common(a: list[str], b: list[str]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- the run --------------------------------------------------------------------------------------


def measure_arm(args: argparse.Namespace, work: Path, model: str, arm: str, texts: tuple) -> tuple[dict, list]:
    """A fresh server for ``arm`` (on / off), ready, measured, stopped."""
    server = Server(args, work, model, arm)
    try:
        ready = server.wait_ready()
        load_before = os.getloadavg()[0]  # other work on the machine shows here (the server's own is in it)
        measured = asyncio.run(load(server.url, *texts, args.max_tokens))
        ready["load_average_1m"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    except BaseException:
        server.stop()
        raise
    code = server.stop()
    if code != 0:
        print(f"bootstrap serve ({arm}) exited with {code}; its log: {server.log_path}", file=sys.stderr)
    result = {"command": server.command, **ready, **summarize(measured), "exit_code_after_sigterm": code}
    return result, measured["rows"]


def run(args: argparse.Namespace, work: Path, report: dict[str, Any]) -> None:
    model, written = model_path(args, work)
    report["model"], report["checkpoint"] = model, written
    system, questions, warmup = prompts(
        vocabulary(args, model), args.requests, args.system_tokens, args.question_tokens
    )
    report["system_prompt_chars"] = len(system)
    save(report, args.out)
    arms: dict[str, dict[str, Any]] = {}
    rows: dict[str, list] = {}
    for arm in (args.first, "off" if args.first == "on" else "on"):
        arms[arm], rows[arm] = measure_arm(args, work, model, arm, (system, questions, warmup))
        report["arms"] = arms
        report["failures"] = merge_failures(arm["failures"] for arm in arms.values())
        save(report, args.out)
    on, off = arms["on"], arms["off"]
    report["ratios"] = {
        "ttft_p50_off_over_on": ratio(off["ttft_ms_p50"], on["ttft_ms_p50"]),
        "ttft_p99_off_over_on": ratio(off["ttft_ms_p99"], on["ttft_ms_p99"]),
        "throughput_on_over_off": ratio(on["output_tokens_per_s"], off["output_tokens_per_s"]),
        "requests_per_s_on_over_off": ratio(on["requests_per_s"], off["requests_per_s"]),
        "wall_off_over_on": ratio(off["wall_s"], on["wall_s"]),
    }
    report["outputs"] = compare(rows["on"], rows["off"])
    targets = TARGETS.get(args.preset)
    if targets and not args.model:
        report["targets"] = {
            name: {"at_least": at, "met": (report["ratios"][name] or 0) >= at} for name, at in targets.items()
        }


def table(report: dict[str, Any]) -> str:
    head = f"{'arm':<5}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'wall s':>9}{'req/s':>8}{'out tok/s':>11}"
    lines = [head + f"{'prompt tok':>12}{'cached tok':>12}{'hit rate':>10}"]
    for arm, row in report.get("arms", {}).items():
        cached = row["cached_tokens"]
        cached_cell = "-" if cached is None else f"{min(c or 0 for c in cached)}-{max(c or 0 for c in cached)}"
        prompt = row["prompt_tokens"] or {}
        cells = [row["ttft_ms_p50"], row["ttft_ms_p99"], row["wall_s"], row["requests_per_s"]]
        lines.append(
            f"{arm:<5}"
            + "".join(f"{_cell(c):>{w}}" for c, w in zip(cells, (13, 13, 9, 8)))
            + f"{_cell(row['output_tokens_per_s']):>11}{prompt.get('min', '-')!s:>12}{cached_cell:>12}"
            + f"{_cell(row['hit_rate']):>10}"
        )
    ratios, outputs = report.get("ratios"), report.get("outputs")
    if ratios:
        lines.append(
            f"TTFT p50 off/on {ratios['ttft_p50_off_over_on']}, p99 off/on {ratios['ttft_p99_off_over_on']}, "
            f"throughput on/off {ratios['throughput_on_over_off']}; outputs equal: {outputs['equal']} "
            f"({outputs['compared'] - outputs['differing']}/{outputs['compared']})"
        )
    if "error" in report:
        lines.append(f"error: {report['error'][:500]}")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def clean_up(work: Path, made: bool, keep: bool, failed: bool) -> None:
    """What the run wrote, removed unless ``--keep``; the servers' logs kept (and named) after a failure."""
    if keep:
        return
    if made and not failed:
        shutil.rmtree(work, ignore_errors=True)
        return
    for name in ("checkpoint", "caches", "tiny.json", *([] if failed else ["serve-on.log", "serve-off.log"])):
        target = work / name
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    if failed:
        print(f"prefix_cache: the servers' logs are under {work}", file=sys.stderr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    began = time.monotonic()
    made = args.work_dir is None
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="prefix-cache-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = report_header("prefix_cache", argv, resolve_device(args.device))
    report["environment"]["cpus"] = os.cpu_count()
    report |= {
        "preset": args.preset,
        "served_model_name": MODEL_ID,
        "requests": args.requests,
        "system_words": args.system_tokens,
        "question_words": args.question_tokens,
        "max_tokens": args.max_tokens,
        "words": args.words,
        "order": [args.first, "off" if args.first == "on" else "on"],
    }
    try:
        run(args, work, report)
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        raise
    finally:
        report["seconds"] = round(time.monotonic() - began, 1)
        save(report, args.out)
        exits = [arm["exit_code_after_sigterm"] for arm in report.get("arms", {}).values()]
        clean_up(work, made, args.keep, failed="error" in report or any(exits))
    print(table(report))
    return report


if __name__ == "__main__":
    sys.exit(failure_exit("prefix_cache", main()["failures"]))
