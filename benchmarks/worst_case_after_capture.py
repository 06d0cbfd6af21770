"""Bootstrap an executor (CUDA graphs captured in ``warmup``), then run a worst-case load on it.

The load: ``max_batch_size`` requests at once, prompts of ``--prompt-len`` tokens (prefilled in
``max_num_tokens`` chunks beside the running decodes), ``--gen-len`` tokens each, so every step
has the largest batch and the prefill steps the largest token count. Prints and writes JSON: the
stage rows, the plan's graph reserve beside the warmup's measured bytes, free memory after the
bootstrap and the lowest free memory seen by the end of the load, torch's peak during it.

With ``--draft-model`` every decode step speculates (``--num-speculative-tokens``, sampled at
``--temperature`` 1 by default: the verify pass and the judging at their heaviest), and the
result adds the pools, the speculation's figures and the most KV blocks seen in use (polled from
``engine_stats``): size ``--prompt-len`` so that the requests fill the target's pool.

    python benchmarks/worst_case_after_capture.py --model random:llama-3.1-8b --out worst.json
    python benchmarks/worst_case_after_capture.py --model random:llama-3.1-8b --draft-model random:llama-3.2-1b \
        --prompt-len 24400 --gen-len 256 --out worst_speculative.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import anyio
import torch

import bootstrap
from bootstrap.engine import SamplingParams


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "float16", "fp8"))
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--num-speculative-tokens", default=None)
    parser.add_argument("--temperature", type=float, default=None, help="default: 1 with a draft, else greedy")
    parser.add_argument("--trace-file", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    depth = args.num_speculative_tokens
    config = bootstrap.BootstrapConfig(
        model=args.model,
        device="cuda",
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        kv_cache_dtype=args.kv_cache_dtype,
        draft_model=args.draft_model,
        num_speculative_tokens=depth if depth in (None, "auto") else int(depth),
    )
    temperature = args.temperature if args.temperature is not None else (1.0 if args.draft_model else 0.0)
    ex, report = await bootstrap.build_executor(config, trace_file=args.trace_file)
    try:
        free_ready = torch.cuda.mem_get_info()[0]
        torch.cuda.reset_peak_memory_stats()
        prompts = [[(7 * i + t) % 1000 + 3 for t in range(args.prompt_len)] for i in range(args.max_batch_size)]
        most_used, done = [0], threading.Event()

        def poll() -> None:
            while not done.wait(0.05):
                most_used[0] = max(most_used[0], ex.engine_stats().kv_used_blocks)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        start = time.perf_counter()
        responses = ex.generate(
            prompts, SamplingParams(max_tokens=args.gen_len, ignore_eos=True, temperature=temperature)
        )
        seconds = time.perf_counter() - start
        done.set()
        poller.join()
        stats = ex.engine_stats()
        result = {
            "command": "python benchmarks/worst_case_after_capture.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
            "device_name": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "stages": report.stages,
            "plan": {
                k: report.plan.get(k)
                for k in (
                    "kv_budget_bytes",
                    "kv_tokens",
                    "graph_bytes",
                    "peak_bytes",
                    "max_num_tokens",
                    "max_batch_size",
                    "max_seq_len",
                )
            },
            "free_after_ready_bytes": free_ready,
            "free_after_load_bytes": torch.cuda.mem_get_info()[0],
            "torch_peak_during_load_bytes": torch.cuda.max_memory_allocated(),
            "torch_reserved_after_load_bytes": torch.cuda.memory_reserved(),
            "pools": report.plan.get("pools"),
            "cuda_graphs": report.plan.get("cuda_graphs"),
            "kv_blocks_total": stats.kv_total_blocks,
            "kv_blocks_most_used": most_used[0],
            "speculation": ex.speculator.stats.to_dict() if ex.speculator is not None else None,
            "temperature": temperature,
            "errors": sorted({r.error for r in responses if r.error}),
            "requests_ok": sum(r.ok and len(r.token_ids) == args.gen_len for r in responses),
            "requests": len(responses),
            "load_s": round(seconds, 2),
        }
    finally:
        ex.shutdown()
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    anyio.run(main)
