"""The floor of a start, in a fresh process of its own: what any server must do before its first
token, each part timed, none of this project's pipeline in the way.

Run by ``cold_start.py`` (with a filled Triton cache, so no kernel compile); alone:

    python benchmarks/floor.py --model DIR --device cuda --pool-bytes N [--max-seq-len ...]

Parts, in this order, each timed:

- ``spawn_to_script_s``: the interpreter's start and this script's own imports (no torch yet);
- ``import_torch_s``, ``device_init_s``: ``import torch``, then the CUDA context;
- the weights, three ways on the same files (page cache as warm for each):
  - ``pinned_pipeline``: plain torch, the recipe the start issue measured: 8 threads read the shards
    into 8 reused page-locked 256 MB buffers and copy each to the GPU on its own stream;
  - ``engine_loader``: the engine's own model code (``load_own_model``: the model built, every
    tensor read into its place, the kernels compiled ahead);
  - ``safetensors_load_file``: ``safetensors.torch.load_file(device=...)`` of each shard (on the
    CPU each tensor copied out of the memory map, so its bytes are read);
- ``pool_s``, ``forward_s``, ``capture_s``: one KV pool of ``--pool-bytes``, one
  ``max_num_tokens`` forward over it through the engine's runner (as profiling runs it), the
  default buckets' decode graphs.

``floor_s`` = ``spawn_to_script_s`` + ``import_torch_s`` + ``device_init_s`` + the fastest of the
weight reads + ``pool_s`` + ``forward_s`` + ``capture_s``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

SCRIPT_START_NS, SCRIPT_CPU_NS = time.time_ns(), time.process_time_ns()  # before any import of this project's own

from bootstrap.pipeline.process import spawn_time_ns  # noqa: E402

SCRIPT_START_S = (SCRIPT_START_NS - spawn_time_ns((SCRIPT_START_NS, SCRIPT_CPU_NS))) / 1e9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint directory (safetensors)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--pool-bytes", type=int, required=True, help="the KV pool's bytes (the plan's budget)")
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-batch-size", type=int, default=64)
    return parser.parse_args()


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_pipeline(files: list[Path], device: Any, threads: int = 8, buffer_bytes: int = 256 << 20) -> dict[str, Any]:
    """Plain torch: every shard's bytes to the device through reused page-locked buffers."""
    import torch

    start = time.perf_counter()
    targets = {f: torch.empty(f.stat().st_size, dtype=torch.uint8, device=device) for f in files}
    jobs = collections.deque((f, o) for f in files for o in range(0, f.stat().st_size, buffer_bytes))

    def worker() -> None:
        buffer = torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True)
        view = memoryview((ctypes.c_char * buffer_bytes).from_address(buffer.data_ptr())).cast("B")
        stream, copied, fds = torch.cuda.Stream(device), None, {}
        try:
            while True:
                try:
                    file, offset = jobs.popleft()
                except IndexError:
                    break
                if file not in fds:
                    fds[file] = os.open(file, os.O_RDONLY)
                fd = fds[file]
                n = min(buffer_bytes, targets[file].numel() - offset)
                if copied is not None:
                    copied.synchronize()
                done = 0
                while done < n:
                    done += os.preadv(fd, [view[done:n]], offset + done)
                with torch.cuda.stream(stream):
                    targets[file][offset : offset + n].copy_(buffer[:n], non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(stream)
            stream.synchronize()
        finally:
            for fd in fds.values():
                os.close(fd)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    synchronize(device)
    seconds = time.perf_counter() - start
    total = sum(t.numel() for t in targets.values())
    targets.clear()  # the device buffers freed (not `del`: the workers' closure names it)
    torch.cuda.empty_cache()
    return {"s": round(seconds, 3), "gb_s": round(total / seconds / 1e9, 2), "bytes": total}


def engine_loader(model_dir: Path, device: Any) -> tuple[Any, dict[str, float]]:

    from bootstrap.engine.models import load_own_model

    start = time.perf_counter()
    model = load_own_model(model_dir, device, None)
    synchronize(device)
    seconds = time.perf_counter() - start
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, {"s": round(seconds, 3), "gb_s": round(total / seconds / 1e9, 2), "bytes": total}


def load_file_read(files: list[Path], device: Any) -> dict[str, float]:
    from safetensors.torch import load_file

    start, total = time.perf_counter(), 0
    for file in files:
        tensors = load_file(str(file), device=str(device))
        if device.type == "cpu":  # a memory map until touched: copied, so every byte is read
            tensors = {k: t.clone() for k, t in tensors.items()}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    synchronize(device)
    seconds = time.perf_counter() - start
    return {"s": round(seconds, 3), "gb_s": round(total / seconds / 1e9, 2), "bytes": total}


def forward_and_captures(model: Any, args: argparse.Namespace, device: Any) -> dict[str, float]:

    from bootstrap.capacity.cuda_graph_buckets import default_batch_sizes
    from bootstrap.engine.executor.create import create_executor
    from bootstrap.engine.executor.profile_run import run_dummy_requests
    from bootstrap.engine.kv_cache import KVCacheSpec, PagedKVCache
    from bootstrap.engine.scheduler import SchedulerConfig

    start = time.perf_counter()
    pool = PagedKVCache.from_bytes(KVCacheSpec.from_config(model.config, model.dtype), args.pool_bytes, 32, device)
    synchronize(device)
    allocated = time.perf_counter()
    executor = create_executor(
        model, pool, SchedulerConfig(args.max_batch_size, args.max_num_tokens, args.max_seq_len), start=False
    )
    full, rest = divmod(args.max_num_tokens, args.max_seq_len - 1)  # each prompt leaves room for its sampled token
    run_dummy_requests(executor, [args.max_seq_len - 1] * full + ([rest] if rest else []))
    synchronize(device)
    forward = time.perf_counter()
    if device.type == "cuda":
        executor.runner.capture_decode_graphs(default_batch_sizes(args.max_batch_size))
    done = time.perf_counter()
    executor.shutdown()
    pool.release()
    return {
        "pool_s": round(allocated - start, 3),
        "forward_s": round(forward - allocated, 3),
        "capture_s": round(done - forward, 3),
    }


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    import torch

    imported = time.perf_counter()
    device = torch.device(args.device)
    torch.empty(1, device=device)
    synchronize(device)
    initialised = time.perf_counter()
    from bootstrap.engine.models.weights import safetensors_files

    files = safetensors_files(args.model)
    reads = {"pinned_pipeline": pinned_pipeline(files, device)} if device.type == "cuda" else {}
    model, reads["engine_loader"] = engine_loader(args.model, device)
    reads["safetensors_load_file"] = load_file_read(files, device)
    rest = forward_and_captures(model, args, device)
    parts = {
        "spawn_to_script_s": round(SCRIPT_START_S, 3),
        "import_torch_s": round(imported - began, 3),
        "device_init_s": round(initialised - imported, 3),
    }
    fastest = min(reads, key=lambda k: reads[k]["s"])
    floor_s = sum(parts.values()) + reads[fastest]["s"] + sum(rest.values())
    print(
        json.dumps(
            {
                **parts,
                "weights": reads,
                "fastest_weights": fastest,
                **rest,
                "floor_s": round(floor_s, 3),
                "pool_bytes": args.pool_bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
