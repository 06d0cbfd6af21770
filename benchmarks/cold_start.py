"""The start a user sees: real ``bootstrap run`` and ``bootstrap serve`` processes on a checkpoint
directory this script writes, timed from the spawn, cold and warm, against the floor.

Per repeat and mode (``cold``: an empty plan cache and an empty Triton cache; ``warm``: both
filled by the cold start before it), from the parent's clock at ``Popen``:

- ``run``: the first line on stderr, ready and the end of the answer (from the trace, counted
  from the spawn), the exit, and the exit's lag behind the answer;
- ``serve``: the first line, the port open, ``GET /ready`` answering 200, the first streamed token
  of a streamed completion, and the exit after SIGTERM (the port and ``/ready`` tried every
  ``--poll-interval`` seconds, 0.1 by default: every try costs the starting server some GIL), and
  ``engine_started_s``, how long after the server's process its engine's process started;
- each with the trace's phase and stage durations (``bootstrap.process.*``) and the share of the
  process the spans cover.

The floor is ``floor.py`` in a fresh process of its own, with the Triton cache the cold start
filled (so no kernel compile): import torch, the device, the weights read three ways (a plain-torch
pinned pipeline, the engine's loader, ``safetensors.torch.load_file``), one pool, one
``max_num_tokens`` forward, the graph captures; ``floor_s`` sums those parts with the fastest read.
``over_floor``: each serve's first token over ``floor_s``. A run that exits non-zero, a serve that
never gets ready or whose completion fails is counted in ``failures`` (its status: the exit, the
HTTP status, or none; the first error's first line) and the script exits 1, with one line on
stderr, the JSON written anyway. Prints JSON and writes it to ``--out``:

    python benchmarks/cold_start.py --shape llama-3.1-8b --device cuda --repeats 3 --out cold_start.json
    python benchmarks/cold_start.py --shape smollm2-135m --device cpu --repeats 3 --out cold_start_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bootstrap.cli.trace.command import read_spans
from bootstrap.cli.trace.timeline import coverage

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_common, also when loaded by path
from bench_common import count_failures, engine_pid, failure_exit, stat_fields  # noqa: E402

WORDS = 512  # the word-level tokenizer written beside the weights: w0 .. w511


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--shape",
        default="smollm2-135m",
        help="a preset (bootstrap plan's presets) or a config.json: the checkpoint's shape",
    )
    add("--device", default="cpu", help="cpu or cuda")
    add("--tp", type=int, default=1, help="tensor-parallel ranks of each run and serve (--tp N; default 1)")
    add("--repeats", type=int, default=3)
    add("--max-seq-len", type=int, default=8192)
    add("--max-num-tokens", type=int, default=8192)
    add("--max-batch-size", type=int, default=64)
    add(
        "--poll-interval",
        type=float,
        default=0.1,
        help="seconds between the client's tries of the port and of "
        "/ready, as a start script polls (each try costs the starting server some of the GIL)",
    )
    add(
        "--workdir", type=Path, default=None, help="where the checkpoint and caches go (default: a temporary directory)"
    )
    add(
        "--serve-args",
        default="",
        help="more flags for each bootstrap serve, one string (e.g. --engine-in-process, the start without the split)",
    )
    add("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def checkpoint_dir(work: Path, shape: str) -> Path:
    """Where the checkpoint of ``shape`` goes: ``checkpoint-<preset>`` (the whole name:
    ``checkpoint-llama-3.1-8b``), or ``checkpoint-<stem>`` for a config file (``tiny.json``:
    ``checkpoint-tiny``)."""
    return work / f"checkpoint-{Path(shape).stem if shape.endswith('.json') else Path(shape).name}"


def write_checkpoint(args: argparse.Namespace, path: Path, seed: int = 0, words: int | None = WORDS) -> dict[str, Any]:
    """The preset's shape (``args.shape``), random bfloat16 weights (float32 on the CPU) drawn
    with ``seed``, a word-level tokenizer of ``words`` words (None: one per token id)."""
    if (path / "config.json").is_file():
        return {"checkpoint": str(path), "written": False}
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    done = subprocess.run(
        [
            sys.executable,
            str(HERE / "write_checkpoint.py"),
            "--model",
            args.shape,
            "--out",
            str(path),
            "--device",
            args.device,
            "--dtype",
            dtype,
            "--seed",
            str(seed),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    words = vocab_size if words is None else min(words, vocab_size)
    vocab = {f"w{i}": i for i in range(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w1", "eos_token": "w2", "unk_token": "w0"}
        )
    )
    return {"checkpoint": str(path), "written": True, **json.loads(done.stdout.strip().splitlines()[-1])}


class Child:
    """A ``bootstrap`` process with its stdout and stderr read line by line, each line timed."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bootstrap.cli", *argv],
            env=env,
            text=True,
            bufsize=1,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.lines: dict[str, list[tuple[float, str]]] = {"stdout": [], "stderr": []}
        self._readers = [threading.Thread(target=self._read, args=(name,), daemon=True) for name in self.lines]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str) -> None:
        for line in getattr(self.proc, name):
            self.lines[name].append((self.now(), line.rstrip("\n")))

    def now(self) -> float:
        return round(time.perf_counter() - self.t0, 3)

    def wait(self, timeout: float = 600.0) -> tuple[int, float]:
        code = self.proc.wait(timeout)
        exited = self.now()
        for reader in self._readers:
            reader.join(5)
        return code, exited


def caches(work: Path, mode: str, repeat: int) -> tuple[dict[str, str], Path]:
    """The environment and plan cache of one start: ``cold`` gets empty ones, ``warm`` the cold
    start's of the same repeat."""
    where = work / f"caches-{repeat}"
    if mode == "cold" and where.exists():
        shutil.rmtree(where)
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(where / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(where / "inductor"),
        "PYTHONUNBUFFERED": "1",
    }
    return env, where / "plans"


def shape_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--device",
        args.device,
        "--tp",
        str(args.tp),
        "--max-seq-len",
        str(args.max_seq_len),
        "--max-num-tokens",
        str(args.max_num_tokens),
        "--max-batch-size",
        str(args.max_batch_size),
    ]


def time_run(args: argparse.Namespace, model: Path, work: Path, mode: str, repeat: int) -> dict[str, Any]:
    env, plans = caches(work, mode, repeat)
    trace = work / f"run-{mode}-{repeat}.jsonl"
    child = Child(
        [
            "run",
            "--model",
            str(model),
            *shape_flags(args),
            "--plan-cache",
            str(plans),
            "--trace-file",
            str(trace),
            "--prompt",
            "w5 w7 w9 w11",
            "--max-tokens",
            "16",
            "--temperature",
            "0",
        ],
        env,
    )
    code, exited = child.wait()
    timed = spans(trace)
    answered = timed.get("trace_answer_end_s")
    return {
        "code": code,
        **({} if code == 0 else {"status": f"exit {code}", "error": _last(child.lines["stderr"])}),
        "first_line_s": _first(child.lines["stderr"]),
        "exit_s": exited,
        "exit_after_answer_s": round(exited - answered, 3) if answered else None,
        **timed,
    }


def time_serve(args: argparse.Namespace, model: Path, work: Path, mode: str, repeat: int) -> dict[str, Any]:
    env, plans = caches(work, mode, repeat)
    trace = work / f"serve-{mode}-{repeat}.jsonl"
    port = _free_port()
    child = Child(
        [
            "serve",
            "--model",
            str(model),
            *shape_flags(args),
            "--plan-cache",
            str(plans),
            "--trace-file",
            str(trace),
            "--port",
            str(port),
            *shlex.split(args.serve_args),
        ],
        env,
    )
    opened = _poll(child, lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close(), args.poll_interval)
    engine = engine_started_s(child.proc.pid)
    ready = _poll(
        child, lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2), args.poll_interval
    )
    answer = _first_token(child, port, str(model)) if ready is not None else {"first_token_s": None}
    early = child.proc.poll()  # not None: it exited by itself
    sigterm = child.now()
    child.proc.send_signal(signal.SIGTERM)
    code, exited = child.wait()
    if ready is None:  # it exited before /ready answered 200, or /ready never did
        answer |= {"status": None if early is None else f"exit {early}"}
        answer["error"] = _last(child.lines["stderr"]) or "no /ready 200"
    return {
        "code": code,
        "first_line_s": _first(child.lines["stderr"]),
        "port_open_s": opened,
        "engine_started_s": engine,
        "ready_s": ready,
        **answer,
        "exit_after_sigterm_s": round(exited - sigterm, 3),
        **spans(trace),
    }


def engine_started_s(server: int) -> float | None:
    """How long after the server's process its engine's process started (``/proc``, in clock
    ticks: 10 ms); None without one (``--engine-in-process``, ``--tp N``) or once it has ended."""
    engine = engine_pid(server)
    try:
        ticks = int(stat_fields(engine)[19]) - int(stat_fields(server)[19]) if engine is not None else None
    except OSError:  # it exited meanwhile
        return None
    return None if ticks is None else round(ticks / os.sysconf("SC_CLK_TCK"), 3)


def _first(lines: list[tuple[float, str]]) -> float | None:
    return lines[0][0] if lines else None


def _last(lines: list[tuple[float, str]]) -> str | None:
    """The last non-blank line a process printed (a failed start's reason)."""
    return next((line for _, line in reversed(lines) if line.strip()), None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _poll(child: Child, probe: Any, interval: float, timeout: float = 600.0) -> float | None:
    """When ``probe()`` first succeeds (an HTTP error or a refused connection: not yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and child.proc.poll() is None:
        try:
            probe()
            return child.now()
        except OSError:
            time.sleep(interval)
    return None


def _first_token(child: Child, port: int, model: str) -> dict[str, Any]:
    """A streamed completion: ``first_token_s`` at its first chunk; ``status`` and ``error`` when
    it is refused, its stream carries an error or ends without a chunk."""
    body = json.dumps({"model": model, "prompt": "w5 w7 w9", "max_tokens": 8, "stream": True})
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body.encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as stream:
            for line in stream:
                if line.startswith(b"data: {"):
                    at = child.now()
                    if "error" in json.loads(line[6:]):
                        return {"first_token_s": None, "status": 200, "error": line[6:].decode(errors="replace")}
                    return {"first_token_s": at}
    except urllib.error.HTTPError as exc:
        return {"first_token_s": None, "status": exc.code, "error": exc.read().decode(errors="replace")[:300]}
    except OSError as exc:
        return {"first_token_s": None, "status": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"first_token_s": None, "status": 200, "error": "the stream ended without a chunk"}


def spans(trace: Path) -> dict[str, Any]:
    """The trace's phases and stages (seconds) and the share of the process they cover."""
    if not trace.is_file():
        return {"spans": None}
    records = read_spans(trace)
    process = next((s for s in records if s["name"] == "bootstrap.process"), None)
    durations = {
        s["name"].removeprefix("bootstrap."): round((s["end_time_unix_nano"] - s["start_time_unix_nano"]) / 1e9, 3)
        for s in records
        if not s["name"].endswith(".attempt")
    }
    share = coverage(records, process) if process is not None else None
    since_spawn = {}  # when (from the spawn) the pipeline and the answer ended
    for name, key in (("bootstrap.pipeline", "trace_ready_s"), ("bootstrap.process.answer", "trace_answer_end_s")):
        ends = [s["end_time_unix_nano"] for s in records if s["name"] == name]
        if process is not None and ends:
            since_spawn[key] = round((max(ends) - process["start_time_unix_nano"]) / 1e9, 3)
    weights = {  # the read's seconds and bytes, the kernels' compile waited after it (estimation_build's attempt)
        key.removeprefix("bootstrap.weights."): value
        for s in records
        for key, value in s["attributes"].items()
        if key.startswith("bootstrap.weights.")
    }
    return {
        **since_spawn,
        "spans": durations,
        "weights": weights,
        "coverage": {k: round(v, 4) for k, v in share.items()} if share else None,
    }


def measure_floor(args: argparse.Namespace, model: Path, pool_bytes: int, env: dict[str, str]) -> dict[str, Any]:
    """``floor.py`` in a fresh process, with ``env``'s (filled) Triton cache: no kernel compile in it."""
    done = subprocess.run(
        [
            sys.executable,
            str(HERE / "floor.py"),
            "--model",
            str(model),
            "--device",
            args.device,
            "--pool-bytes",
            str(pool_bytes),
            "--max-seq-len",
            str(args.max_seq_len),
            "--max-num-tokens",
            str(args.max_num_tokens),
            "--max-batch-size",
            str(args.max_batch_size),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cold-start-"))
    model = checkpoint_dir(work, args.shape)
    result: dict[str, Any] = {
        "benchmark": "cold_start",
        "command": " ".join(sys.argv),
        "shape": args.shape,
        "device": args.device,
        "tp": args.tp,
        "poll_interval_s": args.poll_interval,
        "checkpoint": write_checkpoint(args, model),
        "repeats": [],
    }
    for repeat in range(args.repeats):
        row = {mode: {"run": time_run(args, model, work, mode, repeat)} for mode in ("cold", "warm")}
        for mode in ("cold", "warm"):
            row[mode]["serve"] = time_serve(args, model, work, mode, repeat)
        result["repeats"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    pool = _pool_bytes(work / "run-cold-0.jsonl")
    filled = caches(work, "warm", 0)[0]  # the first repeat's Triton cache: the floor compiles nothing
    result["floor"] = measure_floor(args, model, pool, filled) if pool else {"error": "no KV budget in the cold trace"}
    result["over_floor"] = over_floor(result)
    starts = [row[mode][kind] for row in result["repeats"] for mode in ("cold", "warm") for kind in ("run", "serve")]
    result["failures"] = count_failures((start.get("status"), start.get("error")) for start in starts)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def over_floor(result: dict[str, Any]) -> dict[str, list[float]] | None:
    """Each repeat's serve first token (cold and warm) over the floor."""
    floor_s = result["floor"].get("floor_s")
    if not floor_s:
        return None
    return {
        f"serve_first_token_{mode}": [
            round(r[mode]["serve"]["first_token_s"] / floor_s, 3)
            for r in result["repeats"]
            if r[mode]["serve"].get("first_token_s")
        ]
        for mode in ("cold", "warm")
    }


def _pool_bytes(trace: Path) -> int | None:
    for line in trace.read_text().splitlines() if trace.is_file() else []:
        span = json.loads(line)
        if span["name"] == "bootstrap.stage.capacity":
            return span["attributes"].get("bootstrap.kv.budget_bytes")
    return None


if __name__ == "__main__":
    sys.exit(failure_exit("cold_start", main()["failures"], "starts"))
