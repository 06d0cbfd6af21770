"""The live operations as a client meets them, on real ``bootstrap serve`` processes: a fresh
serve of checkpoint A, then on that server swap A->B, swap B->A, sleep and wake at levels 1 and
2, a weights update of A, and a stress of swaps under streaming traffic; each operation timed
from its POST to the first streamed token after it, beside its floor measured in the same run.

Checkpoints written first (A: llama-3.1-8b; A2: A's shapes, other values; B: qwen3-8b; ``--preset
tiny``: small ones for the CPU). A ``serve --idle`` process gives the device-memory baseline and
is then swapped to A and to B: that fills the plan and kernel caches this run owns, so the
measured server's start and swaps find their plans cached. Floors: swaps, weights and level-2 wake at
the loader's GB/s (the start's read, from the server's trace file: the read runs in the background,
beside ``warmup``'s capture), level-1 wake at a pinned host->device copy's plus the capture.
Every request but a 503 during an operation (a client waits those out) that fails is counted in
``failures`` (HTTP status, the first error's first line); then the exit status is 1, with one line
on stderr, the JSON written anyway. JSON to ``--out``, a short table on stdout:

    python benchmarks/live_ops.py --out benchmarks/results/live_ops_h200.json
    python benchmarks/live_ops.py --preset tiny --device cpu --cycles 2 --out /tmp/live_ops_cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
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
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # bench_common and cold_start, also when loaded by path
from bench_common import count_failures, failure_exit, ratio, save, server_env  # noqa: E402
from cold_start import write_checkpoint  # noqa: E402

MODEL_ID = "live"  # the served model name of every model the servers hold: clients never change it
PROMPT = [5, 7, 9, 11, 13, 17]  # token ids: the word-level tokenizer names every id
GIB, MIB = 1 << 30, 1 << 20
TINY = {  # --preset tiny: two shapes as different as the 8B pair (another family, depth and width)
    "a": {
        **{"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64},
        **{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
        **{"max_position_embeddings": 128, "torch_dtype": "float32"},
    },
    "b": {
        **{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 160, "hidden_size": 48},
        **{"intermediate_size": 96, "num_hidden_layers": 3, "head_dim": 16, "num_attention_heads": 4},
        **{"num_key_value_heads": 2, "max_position_embeddings": 128, "torch_dtype": "float32"},
        "tie_word_embeddings": False,
    },
}
PRESETS = {
    "8b": {"a": "llama-3.1-8b", "b": "qwen3-8b", "flags": []},
    "tiny": {"a": None, "b": None, "flags": ["--max-num-tokens", "64", "--max-batch-size", "4"]},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--preset", choices=sorted(PRESETS), default="8b", help="8b: llama-3.1-8b and qwen3-8b; tiny: a CPU smoke")
    add("--device", default="cuda", help="cuda, cuda:N or cpu (the servers' --device)")
    add("--cycles", type=int, default=20, help="A->B->A swap cycles of the stress")
    add("--skip-stress", action="store_true", help="leave the stress out")
    add("--work-dir", type=Path, help="checkpoints, caches and logs (default: a new directory under /tmp)")
    add("--keep", action="store_true", help="keep what this run wrote in the work dir (checkpoints are reused)")
    add("--copy-bytes", type=int, help="bytes of the host->device copy floor (default 4 GiB on CUDA, 256 MiB on CPU)")
    add("--serve-args", default="", help="flags for every server, one string, instead of the preset's")
    add("--deadline-s", type=float, default=540.0, help="the stress stops early rather than run past this")
    add("--out", type=Path, help="the JSON (default benchmarks/results/live_ops_<device>_<preset>.json)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = HERE / "results" / f"live_ops_{args.device.split(':')[0]}_{args.preset}.json"
    return args


# ---- checkpoints ----------------------------------------------------------------------------------


def write_checkpoints(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A, A2 (A's shapes, seed 1) and B, written side by side by ``write_checkpoint.py``, each with
    a word-level tokenizer naming every token id (so every generated token streams as text)."""
    preset = PRESETS[args.preset]
    shapes = {"a": preset["a"], "a2": preset["a"], "b": preset["b"]}
    if args.preset == "tiny":
        for key, config in TINY.items():
            (work / f"tiny-{key}.json").write_text(json.dumps(config))
        shapes = {"a": str(work / "tiny-a.json"), "a2": str(work / "tiny-a.json"), "b": str(work / "tiny-b.json")}
    paths = {key: work / f"checkpoint-{key}" for key in shapes}
    device = "cuda" if args.device.startswith("cuda") else "cpu"

    def one(key: str) -> dict[str, Any]:
        shape = SimpleNamespace(shape=shapes[key], device=device)
        return {"shape": shapes[key], **write_checkpoint(shape, paths[key], seed=1 if key == "a2" else 0, words=None)}

    with ThreadPoolExecutor(len(paths)) as pool:
        written = dict(zip(paths, pool.map(one, paths)))
    return {key: {**row, "path": str(paths[key])} for key, row in written.items()}


def check_disk(work: Path, preset: str) -> None:
    """Three 8B checkpoints take about 49 GB: refused at once when the disk cannot hold them."""
    if preset != "8b" or (work / "checkpoint-b" / "config.json").is_file():
        return
    free = shutil.disk_usage(work).free
    if free < 52e9:
        raise SystemExit(f"live_ops: {free / 1e9:.1f} GB free under {work}; the three checkpoints need ~49 GB")


# ---- a server and its client ----------------------------------------------------------------------


class Server:
    """``bootstrap serve`` in a subprocess on a free port, its output in a log file, timed from
    the spawn; the caches under ``work`` (plans, Triton, inductor) shared by every server."""

    def __init__(self, args: argparse.Namespace, work: Path, name: str, model: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"{name}.log"
        env = server_env(work / "caches")
        flags = args.serve_args.split() if args.serve_args else PRESETS[args.preset]["flags"]
        command = [
            *("-m", "bootstrap.cli", "serve", "--model", model, "--device", args.device),
            *("--port", str(self.port), "--plan-cache", str(work / "caches" / "plans")),
            *("--served-model-name", MODEL_ID, *flags, *extra),
        ]
        self.command = " ".join(["bootstrap", *command[2:]])
        with self.log_path.open("w") as log:
            self.t0 = time.perf_counter()
            self.proc = subprocess.Popen([sys.executable, *command], env=env, stdout=log, stderr=subprocess.STDOUT)

    def since_spawn(self) -> float:
        return round(time.perf_counter() - self.t0, 3)

    def wait_ready(self, states: tuple[str, ...] = ("ready",), timeout: float = 600.0) -> dict[str, Any]:
        """Spawn to the port open and to ``/ready`` in one of ``states`` (seconds)."""
        port = ready = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                _, body = call(f"{self.url}/ready", timeout=5)
            except OSError:
                time.sleep(0.05)
                continue
            port = port or self.since_spawn()
            if isinstance(body, dict) and body.get("state") in states:
                ready = self.since_spawn()
                break
            if isinstance(body, dict) and body.get("state") == "failed":
                raise RuntimeError(f"the server failed: {body.get('error')}\n{self.log_tail()}")
            time.sleep(0.05)
        if ready is None:
            raise RuntimeError(f"the server never reached {states}\n{self.log_tail()}")
        return {"port_open_s": port, "ready_s": ready}

    def stop(self, timeout: float = 120.0) -> dict[str, Any]:
        """SIGTERM; the exit code and how long the exit took, and any thread the log says was left."""
        if self.proc.poll() is not None:
            return {"code": self.proc.returncode, "exit_s": None}
        start = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        left = [line for line in self.log_tail(50).splitlines() if "threads still alive" in line]
        return {"code": code, "exit_s": round(time.perf_counter() - start, 3), "threads_left": left}

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def call(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> tuple[int, Any]:
    """GET (no body) or POST; the status and the JSON answer (an error's too)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def complete(url: str, max_tokens: int = 8, since: float | None = None, timeout: float = 120.0) -> dict[str, Any]:
    """A greedy streamed completion: the first streamed token's time from ``since`` (default: the
    request), the text, the finish reason; or the HTTP status of a refusal."""
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    start = time.perf_counter() if since is None else since
    first, text, finish = None, [], None
    try:
        with urllib.request.urlopen(request, timeout=timeout) as stream:
            for line in stream:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    return {"status": 200, "error": chunk["error"].get("message")}
                first = first if first is not None else round(time.perf_counter() - start, 4)
                for choice in chunk.get("choices") or []:
                    text.append(choice.get("text") or "")
                    finish = choice.get("finish_reason") or finish
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "error": exc.read().decode(errors="replace")[:300]}
    return {"status": 200, "first_token_s": first, "text": "".join(text), "finish_reason": finish}


def stage_events(url: str, since: float) -> list[dict[str, Any]]:
    """The server's stage events (``/v1/bootstrap/events``, one-off stages included, with their
    figures) from Unix time ``since`` on."""
    events = []
    with urllib.request.urlopen(f"{url}/v1/bootstrap/events", timeout=60) as stream:
        name = None
        for raw in stream:
            line = raw.decode().strip()
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                if name != "stage":
                    break  # the closing event: the phase is settled
                event = json.loads(line[6:])
                if event["at"] >= since:
                    events.append(event)
    return events


def with_figures(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operation's stage rows (``id``, ``outcome``, ``duration_s``...), each with the figures
    its event reported, matched in order."""
    ended = [e for e in events if e["kind"] in ("done", "skipped", "failed")]
    out = []
    for row in rows:
        match = next((e for e in ended if e["stage"] == row["id"]), None)
        if match is not None:
            ended.remove(match)
        keep = ("id", "outcome", "duration_s", "skip_reason", "free_bytes_before", "free_bytes_after", "error")
        out.append({k: row.get(k) for k in keep} | {"figures": match["figures"] if match else {}})
    return out


def operate(server: Server, route: str, body: dict[str, Any], answer_after: bool = True) -> dict[str, Any]:
    """POST an operation, then (``answer_after``) at once a streamed completion: the POST's time,
    the first token's from the POST, the server's duration and stage rows with their figures, and
    the operation's row in ``GET /v1/bootstrap``'s history."""
    since, start = time.time(), time.perf_counter()
    status, answer = call(f"{server.url}{route}", body)
    post_s = round(time.perf_counter() - start, 4)
    row: dict[str, Any] = {"route": route, "body": body, "status": status, "post_s": post_s}
    if status != 200:
        return row | {"error": answer}
    if answer_after:
        done = complete(server.url, since=start)
        row |= {"first_token_s": done.get("first_token_s"), "text": done.get("text"), "answer_status": done["status"]}
        row |= {"answer_error": done["error"]} if "error" in done else {}
    row |= {"state": answer["state"], "server_duration_s": answer["duration_s"]}
    row["answer"] = {k: v for k, v in answer.items() if k not in ("stages", "plan", "state", "duration_s")}
    row["stages"] = with_figures(answer["stages"], stage_events(server.url, since))
    _, view = call(f"{server.url}/v1/bootstrap")
    row["record"] = (view.get("operations") or [None])[-1]  # the history's row (its parts' times, if kept)
    row["plan_cached"] = any(r["id"] == "profiling" and r["skip_reason"] == "plan-cache" for r in row["stages"])
    return row


def stage(rows: list[dict[str, Any]], stage_id: str) -> dict[str, Any]:
    return next((r for r in rows if r["id"] == stage_id), {})


def gb_s(nbytes: int | None, seconds: float | None) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if nbytes and seconds else None


# ---- what the server process holds ----------------------------------------------------------------


def nvidia_smi(*query: str) -> list[list[str]] | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [[cell.strip() for cell in line.split(",")] for line in done.stdout.splitlines() if line.strip()]


def process_mib(pid: int) -> int | None:
    """The device memory nvidia-smi lists for ``pid`` (None: not listed, e.g. another PID namespace)."""
    rows = nvidia_smi("--query-compute-apps=pid,used_memory") or []
    return next((int(row[1]) for row in rows if row[0] == str(pid) and row[1].isdigit()), None)


def device_used_mib(index: int) -> int | None:
    rows = nvidia_smi("--query-gpu=memory.used", "-i", str(index))
    return int(rows[0][0]) if rows and rows[0][0].isdigit() else None


def proc_figures(pid: int) -> dict[str, int | None]:
    """VmRSS, Threads (``/proc/PID/status``) and open file descriptors (``/proc/PID/fd``)."""
    figures: dict[str, int | None] = {"rss_bytes": None, "threads": None, "fds": None}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "VmRSS":
                figures["rss_bytes"] = int(value.split()[0]) * 1024
            elif key == "Threads":
                figures["threads"] = int(value)
        figures["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return figures


class Memory:
    """Snapshots of a server process: RSS, threads, fds and, on CUDA, its device memory
    (nvidia-smi per process and for the device, and the device's free bytes from this process)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.index = int(device.partition(":")[2] or 0)

    def snapshot(self, pid: int) -> dict[str, Any]:
        snap: dict[str, Any] = proc_figures(pid)
        if self.cuda:
            import torch

            snap |= {
                "process_mib": process_mib(pid),
                "device_used_mib": device_used_mib(self.index),
                "device_free_bytes": torch.cuda.mem_get_info(self.index)[0],
            }
        return snap


BASES = (("process_mib", 1), ("device_used_mib", 1), ("device_free_bytes", -1), ("rss_bytes", 1))


def given_back(before: dict[str, Any], after: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """The share of what the server held above ``baseline`` that it gave back: (before - after) /
    (before - baseline) on each measure all three carry (free bytes: the signs turned); the
    ``fraction`` on the first of them: the server's own device memory (nvidia-smi per process),
    else the device's, else the free bytes this process sees, else (the CPU) its RSS."""
    fractions = {}
    for key, sign in BASES:
        held, left, floor = before.get(key), after.get(key), baseline.get(key)
        if None not in (held, left, floor) and sign * (held - floor) > 0:
            fractions[key] = round((held - left) / (held - floor), 4)
    basis = next(iter(fractions), None)
    return {"fraction": fractions.get(basis), "basis": basis, "by_basis": fractions}


def metrics(url: str) -> dict[str, float]:
    """``/metrics``: every ``bootstrap_*`` sample but the histogram buckets."""
    status, text = call(f"{url}/metrics")
    samples = {}
    for line in text.splitlines() if status == 200 and isinstance(text, str) else []:
        if line.startswith("bootstrap_") and "_bucket{" not in line and "_created" not in line:
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


# ---- floors measured here -------------------------------------------------------------------------


def copy_rate(device: str, nbytes: int) -> dict[str, Any]:
    """Best of three copies of a page-locked host tensor to the device (on the CPU: host to host)."""
    import torch

    cuda = device.startswith("cuda")
    source = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del source, target
    if cuda:
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # the page-locked buffer back to the host
    return {"bytes": nbytes, "s": round(best, 6), "gb_s": gb_s(nbytes, best), "pinned": cuda}


def context_baseline(args: argparse.Namespace, work: Path, memory: Memory) -> tuple[dict[str, Any], Server]:
    """A ``serve --idle`` process (torch imported, the device initialized, no model): what a
    server holds with nothing loaded (``context_mib``: nvidia-smi's figure for it, else what it
    added to the device; where it made no CUDA context yet, this process's own bare context).
    Returned running: the warm-up swaps it next."""
    quiet = memory.snapshot(os.getpid()) if memory.cuda else {}
    server = Server(args, work, "idle", args.paths["a"], "--idle")
    row: dict[str, Any] = server.wait_ready(("idle",))
    time.sleep(0.5)  # the backend made: the device initialized
    row["process"] = idle = memory.snapshot(server.proc.pid)
    if memory.cuda:
        row["device_delta_mib"] = delta = _minus(idle["device_used_mib"], quiet.get("device_used_mib"))
        row["bare_context_mib"] = bare = quiet.get("process_mib")  # this process: a context and a freed copy
        row["free_delta_mib"] = fell = (quiet["device_free_bytes"] - idle["device_free_bytes"]) // MIB
        candidates = (
            (idle["process_mib"], "nvidia-smi's figure for a `serve --idle` process"),
            (delta, "the device memory a `serve --idle` process added (not listed by PID)"),
            (fell, "the free device memory a `serve --idle` process took (torch.cuda.mem_get_info)"),
            (bare, "this benchmark's own bare CUDA context (the idle process made none)"),
        )  # under 64 MiB: no CUDA context was made
        row["context_mib"], row["context_source"] = next(
            ((value, source) for value, source in candidates if value is not None and value >= 64),
            (None, "none measured"),
        )
    return row, server


def _minus(a: int | None, b: int | None) -> int | None:
    return a - b if a is not None and b is not None else None


# ---- the run --------------------------------------------------------------------------------------


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    env = {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": args.device,
        "cpus": os.cpu_count(),
    }
    if args.device.startswith("cuda"):
        index = int(args.device.partition(":")[2] or 0)
        env |= {
            "device_name": torch.cuda.get_device_name(index),
            "total_bytes": torch.cuda.mem_get_info(index)[1],
            "cuda": torch.version.cuda,
        }
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    began = time.monotonic()
    made = args.work_dir is None
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="live-ops-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "live_ops",
        "command": " ".join(["python", "benchmarks/live_ops.py", *(argv if argv is not None else sys.argv[1:])]),
        "preset": args.preset,
        "model_id": MODEL_ID,
        "prompt": PROMPT,
    }
    servers: list[Server] = []
    try:
        check_disk(work, args.preset)
        report["environment"] = environment(args)
        report["checkpoints"] = checkpoints = write_checkpoints(args, work)
        args.paths = {key: row["path"] for key, row in checkpoints.items()}
        save(report, args.out)
        run(args, work, report, servers, began)
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        raise
    finally:
        for server in servers:
            if server.proc.poll() is None:
                server.stop()
        report["seconds"] = round(time.monotonic() - began, 1)
        report["failures"] = count_failures(outcomes(report))
        save(report, args.out)
        if args.keep:
            pass
        elif made:
            shutil.rmtree(work, ignore_errors=True)
        else:
            _remove_ours(work)
    print(table(report))
    return report


def outcomes(report: dict[str, Any]) -> list[tuple[int | None, Any]]:
    """Every request the run made, as (HTTP status, error or None): the warm-up's swaps, the first
    completion, each operation and the completion after it, the stress's swaps, its traffic (a 503
    not counted: expected while a swap runs) and the completion after it."""
    rows: list[tuple[int | None, Any]] = []

    def post(row: dict[str, Any]) -> None:
        rows.append((row["status"], row.get("error") if row["status"] != 200 else None))
        if "answer_status" in row:
            rows.append((row["answer_status"], row.get("answer_error")))

    warm = report.get("warmup_process", {})
    for name in ("swap_idle_to_a", "swap_a_to_b"):
        if name in warm:
            post(warm[name])
    if "first_status" in report.get("start", {}):
        rows.append((report["start"]["first_status"], report["start"].get("first_error")))
    for row in report.get("operations", {}).values():
        post(row)
    stress_ = report.get("stress") or {}
    for cycle in stress_.get("cycles", []):
        rows += [(cycle[k]["status"], cycle[k].get("error")) for k in ("to_b", "to_a")]
    sample = next(iter(stress_.get("traffic_error_samples") or []), "see traffic")
    for outcome, n in (stress_.get("traffic") or {}).items():
        status = int(outcome[5:]) if outcome.startswith("http_") else None if outcome == "client_error" else 200
        rows += [(status, None if outcome in ("ok", "http_503") else sample)] * n
    if "answer_after" in stress_:
        rows.append((stress_["answer_after"]["status"], stress_["answer_after"].get("error")))
    return rows


def _remove_ours(work: Path) -> None:
    for name in ("checkpoint-a", "checkpoint-a2", "checkpoint-b", "caches"):
        shutil.rmtree(work / name, ignore_errors=True)
    for path in [*work.glob("*.log"), *work.glob("*.trace.jsonl"), *work.glob("tiny-*.json")]:
        path.unlink(missing_ok=True)


def run(args: argparse.Namespace, work: Path, report: dict[str, Any], servers: list[Server], began: float) -> None:
    memory = Memory(args.device)
    a, a2, b = args.paths["a"], args.paths["a2"], args.paths["b"]
    swap_to = {"a": {"model": a, "served_model_name": MODEL_ID}, "b": {"model": b, "served_model_name": MODEL_ID}}
    copy_bytes = args.copy_bytes or (4 * GIB if memory.cuda else 256 * MIB)
    report["host_to_device_copy"] = copy = copy_rate(args.device, copy_bytes)

    # the baseline, then the caches filled: idle -> A -> B, each swap's plan measured (cold)
    baseline, idle = context_baseline(args, work, memory)
    servers.append(idle)
    warmup = {"idle": baseline, "swap_idle_to_a": operate(idle, "/v1/bootstrap/swap", swap_to["a"])}
    warmup["swap_a_to_b"] = operate(idle, "/v1/bootstrap/swap", swap_to["b"])
    warmup["exit"] = idle.stop()
    report["warmup_process"] = warmup
    save(report, args.out)

    # the measured server: a fresh serve of A, its plan and kernels cached
    quiet = memory.snapshot(os.getpid()) if memory.cuda else {}
    traced = work / "serve.trace.jsonl"  # the background reads' own seconds are on its spans only
    server = Server(args, work, "serve", a, "--trace-file", str(traced))
    servers.append(server)
    start: dict[str, Any] = {"command": server.command, **server.wait_ready()}
    first = complete(server.url, since=server.t0)
    start |= {"first_token_s": first.get("first_token_s"), "text": first.get("text"), "first_status": first["status"]}
    start |= {"first_error": first["error"]} if "error" in first else {}
    _, view = call(f"{server.url}/v1/bootstrap")
    start |= {"time_to_ready_s": view["time_to_ready_s"], "plan": view["plan"], "stages": view["stages"]}
    start["process"] = memory.snapshot(server.proc.pid)
    start["plan_cached"] = stage(view["stages"], "profiling").get("skip_reason") == "plan-cache"
    report["start"] = start
    loaded = stage(start["stages"], "load_model")
    weight_bytes = loaded.get("figures", {}).get("bootstrap.model.weight_bytes")
    first_read = weight_reads(traced)[0]
    loader = {"bytes": first_read["bytes"], "s": first_read["s"], "gb_s": gb_s(first_read["bytes"], first_read["s"])}
    loader["load_model_stage_s"] = loaded.get("duration_s")  # storage and headers: the bytes arrive meanwhile
    start["weight_bytes"] = weight_bytes
    capture_s = stage(start["stages"], "warmup").get("duration_s") or 0.0

    ops: dict[str, Any] = {}
    report["operations"] = ops
    ops["swap_a_to_b"] = operate(server, "/v1/bootstrap/swap", swap_to["b"])
    ops["swap_b_to_a"] = operate(server, "/v1/bootstrap/swap", swap_to["a"])
    save(report, args.out)
    # what the server would hold with nothing loaded: a CUDA context (its RSS on the CPU), per measure
    context: dict[str, Any] = {"rss_bytes": baseline["process"]["rss_bytes"]}
    if memory.cuda:
        held = baseline.get("context_mib")
        context = {
            "process_mib": held,
            "device_used_mib": _plus(quiet.get("device_used_mib"), held),
            "device_free_bytes": quiet["device_free_bytes"] - held * MIB if held is not None else None,
        }
    for level in (1, 2):
        before = memory.snapshot(server.proc.pid)
        slept = operate(server, "/v1/bootstrap/sleep", {"level": level}, answer_after=False)
        after = memory.snapshot(server.proc.pid)
        slept["process_before"], slept["process_after"] = before, after
        slept["given_back"] = given_back(before, after, context)
        ops[f"sleep_level_{level}"] = slept
        ops[f"wake_level_{level}"] = operate(server, "/v1/bootstrap/wake", {})
        save(report, args.out)
    ops["weights_a_to_a2"] = operate(server, "/v1/bootstrap/weights", {"path": a2})
    source = baseline.get("context_source", "the RSS of a `serve --idle` process")
    report["memory_baseline"] = {"context": context, "source": source}
    report["weight_reads"] = weight_reads(traced)
    report["floors"] = floors(ops, loader, copy, capture_s, start, report["weight_reads"])
    save(report, args.out)

    if not args.skip_stress:
        report["stress"] = stress(args, server, memory, swap_to, began, start.get("text"))
    report["exit"] = server.stop()


def _plus(a: int | None, b: int | None) -> int | None:
    return a + b if a is not None and b is not None else None


def weight_reads(trace: Path) -> list[dict[str, Any]]:
    """Each checkpoint read of the traced server, in order: its operation (the root span's name),
    bytes, its own seconds (``bootstrap.weights.target.read_s``, on the span of the attempt that
    waited for it: ``load_model`` returns before the bytes are in), and the seconds waited."""
    spans = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    roots = {s["trace_id"]: s["name"] for s in spans if s["parent_span_id"] is None}
    reads = []
    for span in sorted(spans, key=lambda s: s["end_time_unix_nano"]):
        attrs = span["attributes"]
        if "bootstrap.weights.target.read_s" in attrs:
            reads.append(
                {
                    "operation": roots.get(span["trace_id"]),
                    "stage": attrs.get("bootstrap.stage"),
                    "bytes": attrs["bootstrap.weights.target.read_bytes"],
                    "s": attrs["bootstrap.weights.target.read_s"],
                    "waited_s": attrs.get("bootstrap.weights.waited_s"),
                }
            )
    return reads


def floors(
    ops: dict[str, Any], loader: dict[str, Any], copy: dict[str, Any], capture_s: float, start: dict, reads: list
) -> dict:
    """Each operation's first token against its floor: the bytes it moves at the rate measured in
    this run (the loader's; for a level-1 wake the host->device copy's) and, where graphs are
    captured again, the start's capture seconds (for the swap to B, the swap's own): the longer of
    the two where the read runs in the background, their sum after a level-1 wake's copy."""
    loader_bps = loader["bytes"] / loader["s"] if loader["bytes"] and loader["s"] else None
    copy_bps = copy["bytes"] / copy["s"] if copy["s"] else None

    def at(rate: float | None, nbytes: int | None, capture_s: float = 0.0, overlap: bool = True) -> float | None:
        """A checkpoint's read overlaps the capture (it runs in the background): the longer one;
        a level-1 wake's copy does not."""
        if not rate or not nbytes:
            return None
        return round(max(nbytes / rate, capture_s) if overlap else nbytes / rate + capture_s, 4)

    weights = ops["weights_a_to_a2"]
    read = stage(weights.get("stages", []), "read_weights")
    read_bytes = read.get("figures", {}).get("bootstrap.weights.read_bytes")
    restore = stage(ops["wake_level_1"].get("stages", []), "restore_weights")
    restored = restore.get("figures", {}).get("bootstrap.weights.restored_bytes")
    reload = next((r for r in reversed(reads) if r["operation"] == "bootstrap.wake"), {})
    swap_b = ops["swap_a_to_b"].get("stages", [])
    b_bytes = stage(swap_b, "load_model").get("figures", {}).get("bootstrap.model.weight_bytes")
    rows = {
        "swap_a_to_b": at(loader_bps, b_bytes, stage(swap_b, "warmup").get("duration_s") or 0.0),
        "swap_b_to_a": at(loader_bps, loader["bytes"], capture_s),
        "wake_level_1": at(copy_bps, restored or loader["bytes"], capture_s, overlap=False),
        "wake_level_2": at(loader_bps, loader["bytes"], capture_s),
        "weights_a_to_a2": at(loader_bps, read_bytes),
    }
    over = {name: ratio(ops[name].get("first_token_s"), floor) for name, floor in rows.items()}
    read_s, restore_s, reload_s = read.get("duration_s"), restore.get("duration_s"), reload.get("s")
    rates = {
        "loader": loader,
        "host_to_device_copy_gb_s": copy["gb_s"],
        "capture_s": capture_s,
        "read_weights": {"bytes": read_bytes, "s": read_s, "gb_s": gb_s(read_bytes, read_s)},
        "restore_weights": {"bytes": restored, "s": restore_s, "gb_s": gb_s(restored, restore_s)},
        "wake_level_2_load": {"s": reload_s, "gb_s": gb_s(loader["bytes"], reload_s)},
    }
    rates["read_weights_over_loader"] = ratio(rates["read_weights"]["gb_s"], loader["gb_s"])
    rates["restore_over_copy"] = ratio(rates["restore_weights"]["gb_s"], copy["gb_s"])
    same = {
        "swap_back_same_text": ops["swap_b_to_a"].get("text") == start.get("text"),
        "wake_level_1_same_text": ops["wake_level_1"].get("text") == start.get("text"),
        "wake_level_2_same_text": ops["wake_level_2"].get("text") == start.get("text"),
        "weights_changed_text": weights.get("text") != start.get("text"),
    }
    return {"floor_s": rows, "over_floor": over, "rates": rates, "checks": same}


# ---- the stress -----------------------------------------------------------------------------------


class Traffic(threading.Thread):
    """Short streamed completions back to back until stopped, each outcome counted (a 503 while
    an operation runs is expected: then a pause of 50 ms, as a client honouring it would wait)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True, name="live-ops-traffic")
        self.url, self.halt = url, threading.Event()
        self.counts: Counter[str] = Counter()
        self.samples: list[str] = []

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                done = complete(self.url, max_tokens=4, timeout=120)
            except (OSError, ValueError) as exc:
                self.counts["client_error"] += 1
                self._sample(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)
                continue
            status, finish = done["status"], done.get("finish_reason")
            if status == 200 and "error" not in done:
                self.counts["ok" if finish in ("length", "stop") else f"finish_{finish}"] += 1
                continue
            self.counts["stream_error" if status == 200 else f"http_{status}"] += 1
            if status != 503:
                self._sample(str(done.get("error")))
            time.sleep(0.05)

    def served(self, since: float, timeout: float = 30.0) -> float | None:
        """Seconds from ``since`` (perf counter) to the next completion answered in full."""
        done = self.counts["ok"]
        while self.counts["ok"] == done and time.perf_counter() - since < timeout:
            time.sleep(0.005)
        return round(time.perf_counter() - since, 4) if self.counts["ok"] > done else None

    def _sample(self, text: str) -> None:
        if len(self.samples) < 5:
            self.samples.append(text[:300])


def stress(
    args: argparse.Namespace, server: Server, memory: Memory, swap_to: dict, began: float, text: str | None
) -> dict[str, Any]:
    """``--cycles`` swaps A->B->A while ``Traffic`` streams, each swap followed by one completion
    answered in full on its model (``served_s``: from the POST) before the next; the process
    before and after (and per cycle), the server's counters, every swap's time; stops early at
    ``--deadline-s``. ``text``: A's greedy answer, which the server must give again after."""
    result: dict[str, Any] = {"process_before": memory.snapshot(server.proc.pid), "metrics_before": metrics(server.url)}
    traffic = Traffic(server.url)
    traffic.start()
    cycles, longest = [], 0.0
    for cycle in range(args.cycles):
        left = args.deadline_s - (time.monotonic() - began)
        if left < 2 * longest + 30:
            result["stopped_at_deadline"] = True
            break
        start, row = time.monotonic(), {"cycle": cycle}
        for name in ("b", "a"):
            since = time.perf_counter()
            status, answer = call(f"{server.url}/v1/bootstrap/swap", swap_to[name])
            row[f"to_{name}"] = {
                "status": status,
                "post_s": round(time.perf_counter() - since, 4),
                "server_duration_s": answer.get("duration_s") if isinstance(answer, dict) else None,
                "served_s": traffic.served(since) if status == 200 else None,
                **({} if status == 200 else {"error": answer}),
            }
        row["process"] = memory.snapshot(server.proc.pid)
        longest = max(longest, time.monotonic() - start)
        cycles.append(row)
    traffic.halt.set()
    traffic.join(180)
    after = complete(server.url)  # the server answers after the stress
    result |= {"cycles_done": len(cycles), "cycles": cycles, "traffic": dict(traffic.counts)}
    result |= {"traffic_error_samples": traffic.samples, "answer_after": after}
    result["process_after"] = memory.snapshot(server.proc.pid)
    result["metrics_after"] = metrics(server.url)
    before, end = result["process_before"], result["process_after"]
    result["growth"] = {k: _minus(end.get(k), before.get(k)) for k in ("rss_bytes", "threads", "fds", "process_mib")}
    swaps = [row[k] for row in cycles for k in ("to_b", "to_a")]
    result["swaps_failed"] = sum(s["status"] != 200 for s in swaps)
    result["answer_after_same_text"] = after.get("text") == text
    post = sorted(s["post_s"] for s in swaps)
    result["swap_post_s"] = {"median": post[len(post) // 2], "max": post[-1]} if post else None
    return result


# ---- the table ------------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    ops, floors_ = report.get("operations", {}), report.get("floors", {})
    lines = [f"{'operation':<18}{'POST s':>9}{'1st token s':>13}{'server s':>10}{'floor s':>9}{'x floor':>9}"]
    start = report.get("start", {})
    fresh = (start.get("first_token_s"), start.get("ready_s"))
    lines.append(f"{'serve A (fresh)':<18}{'':>9}{_num(fresh[0]):>13}{_num(fresh[1]):>10}")
    for name, row in ops.items():
        floor = floors_.get("floor_s", {}).get(name)
        over = floors_.get("over_floor", {}).get(name)
        cells = [row.get("post_s"), row.get("first_token_s"), row.get("server_duration_s"), floor, over]
        note = f"  given back {row['given_back']['fraction']}" if "given_back" in row else ""
        lines.append(f"{name:<18}" + "".join(f"{_num(c):>{w}}" for c, w in zip(cells, (9, 13, 10, 9, 9))) + note)
    rates = floors_.get("rates", {})
    if rates:
        lines.append(
            f"GB/s: loader {rates['loader']['gb_s']}, read_weights {rates['read_weights']['gb_s']}, "
            f"host->device copy {rates['host_to_device_copy_gb_s']}, restore {rates['restore_weights']['gb_s']}"
        )
    stress_ = report.get("stress")
    if stress_:
        lines.append(
            f"stress: {stress_['cycles_done']} cycles, swaps failed {stress_['swaps_failed']}, traffic "
            f"{stress_['traffic']}, growth {stress_['growth']}"
        )
    if "error" in report:
        lines.append(f"error: {report['error'][:500]}")
    return "\n".join(lines)


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(failure_exit("live_ops", main()["failures"]))
