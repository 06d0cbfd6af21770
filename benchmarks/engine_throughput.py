"""Native engine (CUDA graphs on and off) vs transformers ``generate()``: prefill and decode
tokens/s side by side, and each decode figure as a fraction of the memory-bandwidth roofline.

All sides run the same weights (the engine's two executors share one copy, switched to paged
attention; transformers loads its own) on the same prompts in the same process, one batch size
after another. ``engine`` runs every step eagerly; ``engine_graphs`` (CUDA only) replays decode
steps from CUDA graphs captured for its batch-size buckets. Per batch size B, prompt length P
and generation length G, for each side:

- ``prefill_s``: wall time of a 1-token generation (prefill plus one sample), best of repeats;
- ``total_s``: wall time of a G-token generation, best of repeats;
- ``prefill_tok_s = B * P / prefill_s``; ``decode_tok_s = B * (G - 1) / (total_s - prefill_s)``;
  ``total_tok_s = B * G / total_s`` (generated tokens per second, end to end).

Generation is forced to G tokens (``ignore_eos`` / ``min_new_tokens``) with greedy sampling;
``identical_outputs`` counts the requests whose token ids are the same as transformers'. The
sides alternate run by run, and the best of ``--repeats`` counts. Prints JSON and writes it to
``--out``.

Roofline: a decode step must read every weight once and the KV cache of every request, so at
best ``steps/s = bandwidth / (weight_bytes + B * kv_bytes_per_token * mean_context)``, with the
mean context of the decode steps ``P + G / 2`` and ``bandwidth`` measured in the same run (a
device-to-device copy of ``--bandwidth-bytes``, counting bytes read and written, best of 10).
``roofline_tok_s = B * steps/s``; every side's ``decode_roofline_fraction`` is its
``decode_tok_s`` over that. On CUDA, ``graph_step_ms`` is one decode graph replay alone
(CUDA events, the bucket of the mean context), so the host's share of a step shows:
``host_ms = 1000 * B / decode_tok_s - graph_step_ms``.

    python benchmarks/engine_throughput.py --device cpu --batch-sizes 1,8,32 \
        --prompt-len 64 --gen-len 16 --out bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when loaded by path
from bench_common import measure_bandwidth

from bootstrap.capacity.cuda_graph_buckets import default_batch_sizes
from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.executor.py_executor import PyExecutor
from bootstrap.engine.kernels import fused
from bootstrap.engine.models.decoder import DecoderLM
from bootstrap.engine.models.weights import checkpoint_tensors
from bootstrap.engine.sources.loader import DEFAULT_MODEL, LoadedWeights, load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENS_PER_BLOCK = 32

Generate = Callable[[list[list[int]], int], list[list[int]]]


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def positive_int(text: str) -> int:
    values = positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer >= 1, got {text!r}")
    return values[0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="any loader source, e.g. random:llama-3.1-8b")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPES], help="auto: float32 on CPU, bfloat16 on CUDA"
    )
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 8, 32], help="e.g. 1,8,32")
    parser.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per request")
    parser.add_argument("--gen-len", type=positive_int, default=32, help="generated tokens per request (>= 2)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="timed runs per figure; the best counts")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="model cache (default ~/.cache/executor-bootstrap)"
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=["both", "on", "off"],
        default="both",
        help="engine sides on CUDA: graphs on and off side by side (both), or one of them",
    )
    parser.add_argument(
        "--graph-variants",
        default="auto",
        help="engine_graphs sides, comma-separated: auto (the runner's choice: the Triton kernel and compiled "
        "RMSNorms where Triton runs), triton, torch (gathering attention), each with +compile or +eager "
        "(RMSNorms compiled or not) or +layers (whole decoder layers compiled), and +unfused (the own model "
        "code's small ops as eager PyTorch instead of its fused Triton kernels), and +overlap (overlap scheduling: "
        "each step launched before the last one's tokens are read), e.g. auto,auto+overlap,triton+compile+unfused",
    )
    parser.add_argument(
        "--bandwidth-bytes",
        type=positive_int,
        default=None,
        help="size of the copy that measures bandwidth (default 2 GiB on CUDA, 256 MiB on the CPU)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.gen_len < 2:
        parser.error("--gen-len must be >= 2: decode speed needs tokens after the first")
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=gen).tolist()


def build_engine(
    loaded: LoadedWeights, args: argparse.Namespace, device: torch.device, graphs: str | None = None
) -> PyExecutor:
    """An executor sized for the largest batch: every prompt prefills in one step. With a
    ``graphs`` variant, its decode steps are captured for the default buckets up to that batch."""
    batch = max(args.batch_sizes)
    seq_len = args.prompt_len + args.gen_len
    spec = KVCacheSpec.from_config(loaded.hf_config, loaded.model.dtype)
    cache = PagedKVCache.from_tokens(spec, batch * (seq_len + TOKENS_PER_BLOCK), TOKENS_PER_BLOCK, device)
    overlap = graphs is not None and "overlap" in graphs.split("+")[1:]
    config = SchedulerConfig(batch, max(batch * args.prompt_len, batch), seq_len, overlap=overlap)
    executor = create_executor(loaded.model, cache, config, loaded.tokenizer, set(loaded.eos_token_ids), start=False)
    if graphs:
        kernel, *options = graphs.split("+")
        executor.runner.decode_kernel = executor.runner._decode_kernel(kernel)
        compile_norms = (
            True if "compile" in options else False if "eager" in options else None
        )  # None: the runner's default
        with unfused_small_ops("unfused" in options):
            capture = executor.runner.capture_decode_graphs(
                default_batch_sizes(batch), compile_norms=compile_norms, compile_layers="layers" in options
            )
        print(
            json.dumps(
                {
                    "variant": graphs,
                    "kernel": executor.runner.decode_kernel,
                    "captured": capture.num_graphs,
                    "batch_sizes": capture.batch_sizes,
                    "widths": capture.widths,
                    "capture_s": round(capture.seconds, 2),
                }
            ),
            file=sys.stderr,
            flush=True,
        )
    return executor


@contextlib.contextmanager
def unfused_small_ops(on: bool) -> Iterator[None]:
    """With ``on``: the own model code's norms, rotary and activation run as eager PyTorch ops
    (its CPU path) instead of its Triton kernels, to measure what the kernels bring."""
    real = fused.usable
    if on:
        fused.usable = lambda x: False
    try:
        yield
    finally:
        fused.usable = real


def side_name(variant: str | None) -> str:
    if variant is None:
        return "engine"
    return "engine_graphs" if variant == "auto" else f"engine_graphs_{variant.replace('+', '_')}"


def roofline(
    batch: int, args: argparse.Namespace, weight_bytes: int, kv_bytes_per_token: int, bandwidth: float
) -> dict:
    context = args.prompt_len + args.gen_len / 2
    step_bytes = weight_bytes + batch * kv_bytes_per_token * context
    return {
        "step_bytes": int(step_bytes),
        "kv_bytes": int(batch * kv_bytes_per_token * context),
        "steps_s": round(bandwidth / step_bytes, 1),
        "roofline_tok_s": round(batch * bandwidth / step_bytes, 1),
    }


def graph_step_ms(executor: PyExecutor, batch: int, args: argparse.Namespace) -> float | None:
    """Milliseconds of one replay of the decode graph a step of ``batch`` at the mean context
    would use (inputs as last filled: timing only), median of 20."""
    runner = executor.runner
    if runner.graphs is None:
        return None
    blocks = -(-(args.prompt_len + args.gen_len // 2) // TOKENS_PER_BLOCK)
    bucket = runner.graphs.bucket(batch, blocks)
    if bucket is None:
        return None
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.graphs.replay(bucket)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2], 3)


def engine_generate(executor: PyExecutor, unfused: bool = False) -> Generate:
    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        with unfused_small_ops(unfused):
            responses = executor.generate(prompts, params)
        failed = [r.error for r in responses if r.error is not None]
        if failed:
            raise RuntimeError(f"engine request failed: {failed[0]}")
        return [r.token_ids for r in responses]

    return run


def hf_generate(model: torch.nn.Module, device: torch.device) -> Generate:
    def run(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        ids = torch.tensor(prompts, device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].tolist()

    return run


def timed(run: Generate, prompts: list[list[int]], max_tokens: int, device: torch.device):
    """Seconds for one run, and its tokens."""
    synchronize(device)
    start = time.perf_counter()
    tokens = run(prompts, max_tokens)
    synchronize(device)
    return time.perf_counter() - start, tokens


def best_times(sides: dict[str, Generate], prompts, args, device) -> dict[str, dict]:
    """Best prefill and total seconds per side; the sides alternate run by run, so a noisy
    neighbour on a shared machine slows both rather than one."""
    best = {name: {"prefill_s": float("inf"), "total_s": float("inf")} for name in sides}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, run in sides.items():
            prefill_s, _ = timed(run, prompts, 1, device)
            total_s, tokens[name] = timed(run, prompts, args.gen_len, device)
            best[name]["prefill_s"] = min(best[name]["prefill_s"], prefill_s)
            best[name]["total_s"] = min(best[name]["total_s"], total_s)
    return {name: {**best[name], "tokens": tokens[name]} for name in sides}


def figures(batch: int, args: argparse.Namespace, prefill_s: float, total_s: float) -> dict:
    decode_s = total_s - prefill_s
    return {
        "prefill_s": round(prefill_s, 4),
        "total_s": round(total_s, 4),
        "prefill_tok_s": round(batch * args.prompt_len / prefill_s, 1),
        # None when timing noise made the G-token run no slower than the 1-token run
        "decode_tok_s": round(batch * (args.gen_len - 1) / decode_s, 1) if decode_s > 0 else None,
        "total_tok_s": round(batch * args.gen_len / total_s, 1),
    }


def ratios(engine: dict, reference: dict) -> dict | None:
    if engine is None:
        return None
    keys = ("prefill_tok_s", "decode_tok_s", "total_tok_s")
    return {
        k.removesuffix("_tok_s"): round(engine[k] / reference[k], 3) if engine[k] and reference[k] else None
        for k in keys
    }


def run_batch_sizes(
    args, device, sides: dict[str, Generate], vocab: int, limits: dict, graphed: dict[str, PyExecutor]
) -> list[dict]:
    results = []
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, vocab, seed=batch)
        best = best_times(sides, prompts, args, device)
        row = {"batch_size": batch, "roofline": roofline(batch, args, **limits)}
        row.update({name: figures(batch, args, b["prefill_s"], b["total_s"]) for name, b in best.items()})
        for name in sides:
            decode = row[name]["decode_tok_s"]
            row[name]["decode_roofline_fraction"] = (
                float(f"{decode / row['roofline']['roofline_tok_s']:.3g}") if decode else None
            )
        for name, executor in graphed.items():
            row[name]["graph_step_ms"] = graph_step_ms(executor, batch, args)
        for name in sides:
            if name.startswith("engine"):
                row[f"{name}_over_transformers"] = ratios(row[name], row["transformers"])
                same = sum(a == b for a, b in zip(best[name]["tokens"], best["transformers"]["tokens"]))
                row[f"{name}_identical_outputs"] = f"{same}/{batch}"  # greedy; random prompts can hit near-ties
        if "engine" in sides:
            row["identical_outputs"] = row["engine_identical_outputs"]
        print(json.dumps(row), file=sys.stderr, flush=True)
        results.append(row)
    return results


def load_pair(args, device, dtype) -> tuple[LoadedWeights, LoadedWeights, float]:
    """Two copies of the same weights; the first load's time."""
    start = time.perf_counter()
    engine_side = load_model(args.model, device=device, dtype=dtype, cache_dir=args.cache_dir)
    load_s = time.perf_counter() - start
    reference = load_model(
        args.model, device=device, dtype=dtype, cache_dir=args.cache_dir, attn_implementation="sdpa"
    )  # transformers' own model and attention: the reference
    if isinstance(engine_side.model, DecoderLM) and args.model.startswith("random:"):
        # random weights drawn in the own code differ from transformers' draw: the reference takes the engine's
        missing, unexpected = reference.model.load_state_dict(checkpoint_tensors(engine_side.model), strict=False)
        if unexpected or any(not name.endswith("inv_freq") for name in missing):
            raise RuntimeError(f"the reference does not take the engine's weights: {missing or unexpected}")
    return engine_side, reference, load_s


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device_name": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    engine_side, reference, load_s = load_pair(args, device, dtype)
    vocab = engine_side.hf_config.get_text_config().vocab_size
    bandwidth = measure_bandwidth(device, args.bandwidth_bytes or (2 << 30 if device.type == "cuda" else 256 << 20))
    variants = [v.strip() for v in args.graph_variants.split(",") if v.strip()]
    modes = {"both": [None, *variants], "on": variants, "off": [None]}[args.cuda_graphs]
    modes = modes if device.type == "cuda" else [None]
    # torch.compile changes the model in place: variants that compile get their own copy of the weights
    own = isinstance(engine_side.model, DecoderLM)
    compiles = [
        v
        for v in modes
        if v
        and (
            {"compile", "layers"} & set(v.split("+")[1:])
            or (v in ("auto", "triton") and device.type == "cuda" and not own)
        )
    ]
    compiled = load_model(args.model, device=device, dtype=dtype, cache_dir=args.cache_dir) if compiles else None
    executors = {
        side_name(v): build_engine(compiled if v in compiles else engine_side, args, device, graphs=v) for v in modes
    }
    sides = {side_name(v): engine_generate(executors[side_name(v)], unfused=bool(v and "+unfused" in v)) for v in modes}
    sides["transformers"] = hf_generate(reference.model, device)
    warm = make_prompts(1, min(args.prompt_len, 8), vocab)
    for run in sides.values():
        run(warm, 2)
    spec = KVCacheSpec.from_config(engine_side.hf_config, engine_side.model.dtype)
    limits = {
        "weight_bytes": engine_side.weight_bytes,
        "kv_bytes_per_token": spec.bytes_per_token,
        "bandwidth": bandwidth,
    }
    try:
        graphed = {name: ex for name, ex in executors.items() if ex.runner.graphs is not None}
        results = run_batch_sizes(args, device, sides, vocab, limits, graphed)
    finally:
        for executor in executors.values():
            executor.shutdown()
    report = {
        "benchmark": "engine_throughput",
        "command": " ".join(
            ["python", "benchmarks/engine_throughput.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "model": args.model,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "repeats": args.repeats,
        "load_s": round(load_s, 3),
        "weight_bytes": engine_side.weight_bytes,
        "kv_bytes_per_token": spec.bytes_per_token,
        "bandwidth_bytes_s": round(bandwidth),
        "cuda_graphs": args.cuda_graphs if device.type == "cuda" else "off (cpu)",
        "graph_variants": {side_name(v): v for v in modes if v is not None},
        "environment": environment(device),
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
