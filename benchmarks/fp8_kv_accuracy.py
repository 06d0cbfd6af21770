"""An e4m3 KV cache against a full-precision one, on the CPU with the default model
(SmolLM2-135M-Instruct, float32 weights): the perplexity of a fixed text read in prefill chunks
of ``--chunk`` tokens (each attends the rounded keys and values of those before it and its
own, as every read of an e4m3 pool does); and greedy agreement over
256 generated tokens of one chat prompt with the float32 cache's (the equal prefix, and the share
of equal positions), beside a bfloat16 cache's agreement for scale.

    python benchmarks/fp8_kv_accuracy.py --out benchmarks/results/fp8_kv_accuracy_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio
import torch
from bench_common import emit, ratio, report_header
from fp8_perplexity import TEXT, perplexity

from bootstrap.api import Bootstrap
from bootstrap.config import BootstrapConfig
from bootstrap.engine import SamplingParams
from bootstrap.engine.sources.loader import load_model

MODEL = "smollm2-135m-instruct"
GENERATED = 256
QUESTION = "Explain in a few paragraphs how a river shapes the valley it runs through."


async def greedy(kv_cache_dtype: str, prompt: list[int]) -> list[int]:
    boot = Bootstrap(BootstrapConfig(model=MODEL, device="cpu", kv_cache_dtype=kv_cache_dtype, plan_cache=None))
    try:
        executor = await boot.build()
        rid = executor.enqueue(prompt, SamplingParams(max_tokens=GENERATED, ignore_eos=True))
        return list(executor.await_response(rid, 600).token_ids)
    finally:
        await boot.aclose()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=16, help="prefill tokens per step for the perplexity")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = report_header("fp8_kv_accuracy", argv, torch.device("cpu"))
    loaded = load_model(MODEL, device=torch.device("cpu"))
    ids = loaded.tokenizer.encode(TEXT)
    full = perplexity(loaded.model, ids, torch.float32, args.chunk)
    fp8 = perplexity(loaded.model, ids, torch.float8_e4m3fn, args.chunk)
    report["perplexity"] = {
        "tokens": len(ids),
        "chunk": args.chunk,
        "float32_kv": round(full, 4),
        "fp8_kv": round(fp8, 4),
        "ratio": ratio(fp8, full),
    }
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    reference = anyio.run(greedy, "auto", prompt)
    report["greedy_agreement"] = {"tokens": GENERATED}
    for kv in ("fp8", "bfloat16"):
        same = [a == b for a, b in zip(reference, anyio.run(greedy, kv, prompt))]
        report["greedy_agreement"][f"{kv}_kv"] = {
            "equal_prefix_tokens": same.index(False) if False in same else len(same),
            "equal_share": round(sum(same) / len(same), 3),
        }
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
