"""One layer's attention of a prefill chunk after cached tokens, as the engine runs it, over
shapes it has not seen and then over the same shapes again.

A long prompt split in ``max_num_tokens`` chunks attends, from its second chunk on, its cached
tokens and its own (``attention.attend``, ``layers.gathered``). For each ``--kv-dtypes`` entry:
a one-layer pool of the model shape, one request whose ``--chunk`` new tokens follow ``context -
chunk`` cached ones, for ``--shapes`` contexts from ``--context`` up in steps of ``--stride``
tokens; milliseconds per call on a first pass over the shapes (after one call outside them) and
a second pass over the same ones (their ratio: what a shape's first call pays once). Three ways:
the engine's (SDPA under a lower-right causal bias); its masked call, which layers with a window
or a soft-cap take (``masked``: keys and values repeated per query head); and the masked call
with grouped heads that it replaced (``grouped``), each with SDPA's backend and its largest
difference from the engine's output. On an H100, cuDNN took the masked calls, ~0.2 s a new shape.

    python benchmarks/prefill_chunk_attention.py --kv-dtypes bfloat16,fp8 --out prefill_chunk.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_common, also when loaded by path
from bench_common import emit, name_list, positive_int, ratio, report_header, resolve_device, synchronize

from bootstrap.backends.native.loading import KV_DTYPES as LOADING_KV_DTYPES
from bootstrap.engine.kv_cache import KVCacheSpec, PagedKVCache
from bootstrap.engine.layers.attention import AttentionMetadata, attend

KV_DTYPES = {name: LOADING_KV_DTYPES[name] for name in ("bfloat16", "float32", "fp8")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="queries, keys, values")
    parser.add_argument("--kv-dtypes", type=name_list(KV_DTYPES), default=["bfloat16"])
    parser.add_argument("--heads", type=positive_int, default=32)
    parser.add_argument("--kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--tokens-per-block", type=positive_int, default=32)
    parser.add_argument("--chunk", type=positive_int, default=2048)
    parser.add_argument("--context", type=positive_int, default=4096, help="cached plus new tokens, first shape")
    parser.add_argument("--stride", type=positive_int, default=37)
    parser.add_argument("--shapes", type=positive_int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.chunk >= args.context:
        parser.error(f"--chunk: below --context ({args.context}), so tokens are cached before it, not {args.chunk}")
    return args


def step(pool: PagedKVCache, context: int, chunk: int, on_host: bool = True) -> AttentionMetadata:
    """One request, blocks 0.. in order, its last ``chunk`` tokens new; its lengths on the host
    as ``ModelRunner`` gives them (``on_host``), else unknown, which leaves the masked call."""
    tpb = pool.tokens_per_block
    blocks = -(-context // tpb)
    device = pool.device
    slots = torch.arange(context - chunk, context, device=device)  # block i holds positions i * tpb ..
    lens = lambda n: torch.tensor([n], device=device)  # noqa: E731
    tables = torch.arange(blocks, device=device).unsqueeze(0)
    lengths = ((context, chunk),) if on_host else ()
    return AttentionMetadata.single(pool, slots, tables, lens(context), lens(chunk), chunk, blocks, lengths=lengths)


def backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> str | None:
    """The backend SDPA picks for a masked call (torch's private chooser; None where absent)."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, enable_gqa=k.shape[1] != q.shape[1])
        return torch.nn.attention.SDPBackend(choice).name
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def cached(pool: PagedKVCache, slots: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """The layer's keys and values ``[1, KVH, K, D]`` at ``slots``, dequantized."""
    kv = []
    for cache, scales in ((pool.k_cache(0), pool.k_scale(0)), (pool.v_cache(0), pool.v_scale(0))):
        part = cache.view(-1, *cache.shape[2:])[slots.reshape(-1)].to(dtype)
        kv.append((part * scales.to(dtype) if cache.dtype == torch.float8_e4m3fn else part).transpose(0, 1)[None])
    return kv


def grouped(pool: PagedKVCache, q: torch.Tensor, context: int, scale: float, chunk: int) -> torch.Tensor:
    """``attend``'s call before its keys and values were repeated per query head: the masked SDPA
    with grouped heads (which leaves SDPA's efficient kernel out)."""
    group = step(pool, context, chunk).groups[0]
    kv = cached(pool, group.kv_slots, q.dtype)
    query = q[group.query_index].transpose(1, 2)
    return F.scaled_dot_product_attention(query, *kv, attn_mask=group.mask(None), scale=scale, enable_gqa=True)


def passes(call, contexts: list[int], device: torch.device) -> list[float]:
    """Milliseconds per call over ``contexts``, then over them again."""
    result = []
    for _ in range(2):
        seconds = []
        for context in contexts:
            synchronize(device)
            start = time.perf_counter()
            call(context)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        result.append(round(1e3 * sum(seconds) / len(seconds), 3))
    return result


def measure(args: argparse.Namespace, kv_dtype: str, device: torch.device) -> dict:
    dtype = getattr(torch, args.dtype)
    contexts = [args.context + i * args.stride for i in range(args.shapes)]
    tpb, scale = args.tokens_per_block, args.head_dim**-0.5
    spec = KVCacheSpec(1, args.kv_heads, args.head_dim, KV_DTYPES[kv_dtype])
    pool = PagedKVCache(spec, -(-contexts[-1] // tpb), tpb, device)
    generator = torch.Generator(device=device).manual_seed(0)
    new = lambda heads: torch.randn(args.chunk, heads, args.head_dim, generator=generator, device=device, dtype=dtype)  # noqa: E731
    q, k, v = new(args.heads), new(args.kv_heads), new(args.kv_heads)
    engine = lambda context: attend(step(pool, context, args.chunk), 0, q, k, v, scale)  # noqa: E731
    masked = lambda context: attend(step(pool, context, args.chunk, on_host=False), 0, q, k, v, scale)  # noqa: E731
    ways = {"": engine, "masked_": masked, "grouped_": lambda context: grouped(pool, q, context, scale, args.chunk)}
    for call in ways.values():
        call(contexts[0] - 1)  # the process's own first costs
    out = engine(contexts[0]).float()
    group = step(pool, contexts[0], args.chunk).groups[0]
    padded_q, width = q[group.query_index].transpose(1, 2), group.kv_slots.shape[1]
    result = {"kv_dtype": kv_dtype, "contexts": contexts}
    for name, call in ways.items():
        first, second = passes(call, contexts, device)
        result |= {f"{name}first_pass_ms": first, f"{name}second_pass_ms": second}
        result[f"{name}first_over_second"] = ratio(first, second)
        if name:
            other = call(contexts[0])
            other = other[0].transpose(0, 1) if other.dim() == 4 else other  # grouped: padded [1, H, Q, D]
            result[f"{name}max_abs_difference"] = round((out - other.float()).abs().max().item(), 6)
            kv = torch.zeros(1, args.heads if name == "masked_" else args.kv_heads, width, args.head_dim, device=device)
            result[f"{name}sdpa_backend"] = backend(padded_q, kv.to(dtype), kv.to(dtype), group.mask(None))
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    report = report_header("prefill_chunk_attention", argv, device)
    report["shape"] = {k: getattr(args, k) for k in ("heads", "kv_heads", "head_dim", "tokens_per_block", "chunk")}
    report["results"] = [measure(args, kv_dtype, device) for kv_dtype in args.kv_dtypes]
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
