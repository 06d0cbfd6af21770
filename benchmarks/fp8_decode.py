"""FP8 checkpoints (or an FP8 KV cache) against their 16-bit source on one GPU: decode and
prefill tokens/s, each decode figure as a fraction of its own bandwidth roofline, the plan's KV
tokens, and greedy agreement with the first side's answers. In-process figures (one process,
engines built one after another through the pipeline with the default flags but
``--max-batch-size``, the prefix cache off (repeats send the same prompts) and a side's own
settings: ``NAME=DIR,kv_cache_dtype=fp8``).

Per checkpoint and batch size B (prompts of P tokens, G generated, greedy, EOS ignored):
``half_s`` is the wall time of a G/2-token generation and ``total_s`` of a G-token one, best
of ``--repeats`` after a first G/2 one (``first_half_s``: its excess is what the batch's first
requests pay once); ``decode_tok_s = B * (G - G/2) / (total_s - half_s)``: the steps the longer
run adds, every request decoding (while G/2 outlasts the prompts' prefill steps, which the two
runs share, long prompts' mixed steps included: ``all_decoding``). Prefill throughput is ``--prefill-batch``
prompts of ``--prefill-len`` tokens with one token each. Roofline: a decode step reads every
weight but the embedding table once, and the KV of every request: ``roofline_tok_s = B *
bandwidth / (step_weight_bytes + B * kv_bytes_per_token * (P + 3G / 4))``,
``bandwidth`` a device-to-device copy measured in the same run (``bench_common``). Agreement: one prompt,
``--agreement-tokens`` greedy tokens, the share of positions equal to the 16-bit checkpoint's up to its first
difference and overall, and how many of the first token's 20 most likely tokens the two share
(random weights: a sanity check, not an accuracy figure).

    python benchmarks/fp8_decode.py --checkpoint bf16=/tmp/llama-8b \
        --checkpoint channel=/tmp/llama-8b-channel --checkpoint block=/tmp/llama-8b-block --out fp8.json
    python benchmarks/fp8_decode.py --checkpoint bf16=/tmp/llama-8b \
        --checkpoint fp8kv=/tmp/llama-8b,kv_cache_dtype=fp8 --batch-sizes 64 --prompt-len 4096 --out fp8_kv.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when loaded by path
from bench_common import emit, measure_bandwidth, positive_int, ratio, release_memory, report_header, synchronize

from bootstrap.api import Bootstrap
from bootstrap.capacity import kv_dtype_bytes
from bootstrap.config import BootstrapConfig
from bootstrap.engine import SamplingParams
from bootstrap.stages.summary import plan_summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint",
        action="append",
        required=True,
        metavar="NAME=DIR[,FIELD=VALUE...]",
        help="a checkpoint to measure, with config fields of its own; the first is the reference",
    )
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=positive_int, default=128)
    parser.add_argument("--gen-len", type=positive_int, default=128)
    parser.add_argument("--prefill-batch", type=positive_int, default=16)
    parser.add_argument("--prefill-len", type=positive_int, default=1024)
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--bandwidth-bytes", type=positive_int, default=4 << 30, help="the copy that measures bandwidth"
    )
    parser.add_argument("--agreement-tokens", type=positive_int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.gen_len < 2:
        parser.error(f"--gen-len: at least 2 (the decode figure times G/2 against G tokens), not {args.gen_len}")
    return args


def prompts(batch: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator).tolist()


def timed(executor, batch_prompts: list[list[int]], max_tokens: int, device: torch.device) -> tuple[float, list]:
    synchronize(device)
    start = time.perf_counter()
    responses = executor.generate(batch_prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    synchronize(device)
    failed = [r.error for r in responses if r.error is not None]
    if failed:
        raise RuntimeError(f"a request failed: {failed[0]}")
    return time.perf_counter() - start, [list(r.token_ids) for r in responses]


def step_weight_bytes(model: torch.nn.Module) -> int:
    """What a decode step reads of the weights: every parameter but the embedding table (a
    tied head is read as the head)."""
    embed = model.model.embed_tokens.weight
    tied = model.get_output_embeddings().weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or tied)


def kv_bytes_per_token(shape, kv_dtype: str) -> float:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_dtype_bytes(kv_dtype)


async def measure(name: str, side: str, args: argparse.Namespace, bandwidth: float) -> dict:
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    path, *fields = side.split(",")
    own = dict(field.split("=", 1) for field in fields)
    settings = dict(device=args.device, max_batch_size=max(batches), plan_cache=None, prefix_caching=False)
    config = BootstrapConfig(model=path, **settings | own)
    boot = Bootstrap(config)
    try:
        started = time.perf_counter()
        executor = await boot.build()
        artifacts = boot.pipeline.artifacts
        result = {"checkpoint": path, "config": own, "build_s": round(time.perf_counter() - started, 2)}
        model = artifacts["loaded"].handle.target.model
        shape, kv_dtype = artifacts["resolved"].shape, artifacts["resolved"].kv_dtype
        result["weight_bytes"] = artifacts["loaded"].weight_bytes
        result["step_weight_bytes"] = weight_bytes = step_weight_bytes(model)
        plan = plan_summary(artifacts)
        result["kv_tokens"], result["kv_budget_bytes"] = plan.get("kv_tokens"), plan.get("kv_budget_bytes")
        timed(executor, prompts(2, 16, 9, shape.vocab_size), 4, device)  # the first requests' one-time costs
        per_batch = {}
        for batch in batches:
            batch_prompts = prompts(batch, args.prompt_len, batch, shape.vocab_size)
            half, half_s, total_s = args.gen_len // 2, float("inf"), float("inf")
            first_half_s = timed(executor, batch_prompts, half, device)[0]  # the shape's one-time costs
            for _ in range(args.repeats):
                half_s = min(half_s, timed(executor, batch_prompts, half, device)[0])
                total_s = min(total_s, timed(executor, batch_prompts, args.gen_len, device)[0])
            decode = batch * (args.gen_len - half) / (total_s - half_s)
            context = args.prompt_len + 3 * args.gen_len / 4
            step_bytes = weight_bytes + batch * kv_bytes_per_token(shape, kv_dtype) * context
            roofline = batch * bandwidth / step_bytes
            prefill_steps = -(-batch * args.prompt_len // config.max_num_tokens)
            per_batch[str(batch)] = {
                "first_half_s": round(first_half_s, 4),
                "half_s": round(half_s, 4),
                "prefill_steps": prefill_steps,
                "all_decoding": half >= prefill_steps,
                "total_s": round(total_s, 4),
                "decode_tok_s": round(decode, 1),
                "roofline_tok_s": round(roofline, 1),
                "decode_roofline_fraction": round(decode / roofline, 3),
            }
        result["batches"] = per_batch
        long_prompts = prompts(args.prefill_batch, args.prefill_len, 99, shape.vocab_size)
        prefill_s = min(timed(executor, long_prompts, 1, device)[0] for _ in range(args.repeats))
        result["prefill_tok_s"] = round(args.prefill_batch * args.prefill_len / prefill_s, 1)
        params = SamplingParams(max_tokens=args.agreement_tokens, ignore_eos=True, logprobs=20)
        greedy = executor.generate(prompts(1, 32, 7, shape.vocab_size), params)[0]
        if greedy.error is not None:
            raise RuntimeError(f"the agreement request failed: {greedy.error}")
        result["greedy_tokens"], result["first_top"] = list(greedy.token_ids), [t for t, _ in greedy.logprobs[0].top]
        return result
    finally:
        await boot.aclose()
        release_memory(device)


def agreement(tokens: list[int], reference: list[int]) -> dict:
    same = [a == b for a, b in zip(tokens, reference)]
    first = same.index(False) if False in same else len(same)
    return {"equal_prefix_tokens": first, "equal_share": round(sum(same) / len(same), 3)}


def shared_top(top: list[int], reference: list[int]) -> int:
    return len(set(top) & set(reference))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    report = report_header("fp8_decode", argv, device)
    report["bandwidth_bytes_s"] = bandwidth = measure_bandwidth(device, args.bandwidth_bytes)
    sides = dict(item.split("=", 1) for item in args.checkpoint)
    results = {name: anyio.run(measure, name, path, args, bandwidth) for name, path in sides.items()}
    reference_name = next(iter(sides))
    reference = results[reference_name]
    for name, result in results.items():
        if name == reference_name:
            continue
        result["agreement"] = agreement(result["greedy_tokens"], reference["greedy_tokens"])
        result["agreement"]["first_token_top20_shared"] = shared_top(result["first_top"], reference["first_top"])
        result["vs_" + reference_name] = {
            "decode_tok_s": {
                b: ratio(f["decode_tok_s"], reference["batches"][b]["decode_tok_s"])
                for b, f in result["batches"].items()
            },
            "prefill_tok_s": ratio(result["prefill_tok_s"], reference["prefill_tok_s"]),
            "kv_tokens": ratio(result["kv_tokens"], reference["kv_tokens"]),
        }
    for result in results.values():
        del result["greedy_tokens"], result["first_top"]
    report["results"] = results
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
