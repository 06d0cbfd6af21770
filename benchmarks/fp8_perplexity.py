"""Perplexity of a fixed text with 16-bit weights and with ``quantization: fp8`` (the projections
quantized at load, one scale per output row), on the CPU: the default model (SmolLM2-135M-Instruct)
on an English paragraph, and a tiny randomly initialised checkpoint of each family the own code
runs, written here, on seeded random tokens (near-uniform predictions: their ratio is the figure,
not the perplexity). One prefill of the whole text per side, logits at every position.

    python benchmarks/fp8_perplexity.py --dtype bfloat16 --out fp8_perplexity.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from bench_common import emit, ratio, report_header

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.request.sequence import Sequence, next_request_id
from bootstrap.engine.sources.loader import load_model

TEXT = (
    "The river rises in the hills to the north of the town and runs south through a wide valley of farms "
    "and woods before it reaches the sea. For centuries the town lived from the river: mills stood along its "
    "banks, boats carried wool and grain down to the harbour, and the bridge at the market square was the only "
    "crossing for twenty miles. When the railway came in the last century, the boats disappeared within a few "
    "years, and most of the mills closed soon after. Today the old buildings hold workshops, a small museum "
    "and a library, and on summer evenings people walk along the towpath to watch the herons fishing in the "
    "shallows. The town council has plans to restore the lock gates, so that small boats can once again reach "
    "the market square from the sea, but the work depends on money that has not yet been found."
)
SHAPE = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 64},
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "gemma": {"head_dim": 32},
    "gemma2": {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 64, "final_logit_softcapping": 30.0},
}
RANDOM_TOKENS = 256


def perplexity(model: torch.nn.Module, ids: list[int], kv_dtype: torch.dtype, chunk: int) -> float:
    """exp of the mean negative log-likelihood of ``ids[1:]``, the text prefilled ``chunk`` tokens a
    step (its whole length: one prefill), logits at every position."""
    cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, kv_dtype), len(ids) + 32, 16, "cpu")
    executor = create_executor(model, cache, SchedulerConfig(1, chunk, len(ids) + 1), start=False)
    seq = Sequence(next_request_id(), list(ids), SamplingParams(max_tokens=1))
    logits = []
    try:
        executor.scheduler.add(seq)
        while seq.num_computed < len(ids):
            batch = executor.scheduler.schedule()
            inputs = executor.runner.prepare_mixed(batch)
            with torch.inference_mode():
                logits.append(executor.runner._forward(inputs.input_ids, inputs.positions, 0, inputs.metadata))
            for member, count in zip(batch.seqs, batch.num_new_tokens):
                member.num_computed += count
        nll = torch.nn.functional.cross_entropy(torch.cat(logits)[:-1].float(), torch.tensor(ids[1:]))
        return math.exp(nll.item())
    finally:
        executor.scheduler.drain()  # the steps ran outside the executor's loop
        executor.shutdown()


def weights_perplexity(source: str, ids: list[int], dtype: torch.dtype, quantize: str | None) -> float:
    """``perplexity`` in one prefill of ``source`` loaded in ``dtype`` (``quantize``: as it loads)."""
    model = load_model(source, device=torch.device("cpu"), dtype=dtype, quantize=quantize).model
    return perplexity(model, ids, model.dtype, len(ids))


def tiny_checkpoint(family: str, root: Path) -> Path:
    """A tiny random checkpoint of ``family`` (transformers' initialisation, seed 0) on disk."""
    config = {"model_type": family, **SHAPE, **FAMILIES[family], "torch_dtype": "float32"}
    spec = root / f"{family}.json"
    spec.write_text(json.dumps(config))
    loaded = load_model(f"random:{spec}", device=torch.device("cpu"), attn_implementation="eager", seed=0)
    loaded.model.save_pretrained(root / family)
    return root / family


def side_by_side(source: str, ids: list[int], dtype: torch.dtype) -> dict:
    plain, fp8 = weights_perplexity(source, ids, dtype, None), weights_perplexity(source, ids, dtype, "fp8")
    return {
        "tokens": len(ids),
        "perplexity": round(plain, 4),
        "perplexity_fp8": round(fp8, 4),
        "ratio": ratio(fp8, plain),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the 16-bit side's dtype")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    report = report_header("fp8_perplexity", argv, torch.device("cpu"))
    default = load_model("smollm2-135m-instruct", device=torch.device("cpu"))
    ids = default.tokenizer(TEXT)["input_ids"] if callable(default.tokenizer) else default.tokenizer.encode(TEXT)
    del default
    results = {"smollm2-135m-instruct": side_by_side("smollm2-135m-instruct", list(ids), dtype)}
    generator = torch.Generator().manual_seed(0)
    random_ids = torch.randint(3, SHAPE["vocab_size"], (RANDOM_TOKENS,), generator=generator).tolist()
    with tempfile.TemporaryDirectory() as root:
        for family in FAMILIES:
            results[f"tiny-{family}"] = side_by_side(str(tiny_checkpoint(family, Path(root))), random_ids, dtype)
    report["results"] = results
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
