"""KV blocks and prefill tokens of ``n`` choices of one prompt, against ``n`` separate requests.

For each ``n``, the real engine (a random llama of ``--layers`` on ``--device``, ``--tpb`` tokens
per block) answers one ``--prompt-len`` prompt as ``n`` choices (``PyExecutor.enqueue_choices``)
and, side by side, as ``n`` separate requests of the same prompt. Per way, it records the prompt
tokens the model ran (prefill), the KV blocks in use right after the prefill and at their peak,
and the blocks shared; and checks that greedy choices equal the separate requests' outputs.

    python benchmarks/choices_kv.py --prompt-len 512 --n 1,2,4,8 --out benchmarks/results/choices_kv_cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_common import emit, positive_int, report_header, resolve_device
from transformers import LlamaConfig, LlamaForCausalLM

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=positive_int, default=512)
    parser.add_argument("--max-tokens", type=positive_int, default=16)
    parser.add_argument("--n", default="1,2,4,8", help="comma-separated choice counts")
    parser.add_argument("--tpb", type=positive_int, default=32, help="tokens per KV block (the server's default)")
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def build(device: torch.device, args: argparse.Namespace, batch: int):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    model = LlamaForCausalLM(config).eval().to(device)
    cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(config, torch.float32), 64 * 1024, args.tpb, device)
    executor = create_executor(model, cache, SchedulerConfig(batch, 4096, 2048), start=False, eos_token_ids=set())
    return executor


class Counted:
    """The runner's forward, counting the tokens it runs and the blocks in use after each step."""

    def __init__(self, executor) -> None:
        self.executor, self.tokens, self.blocks = executor, 0, []
        self._run = executor.runner.run
        executor.runner.run = self.run

    def run(self, batch, *args, **kwargs):
        self.tokens += batch.total_tokens
        out = self._run(batch, *args, **kwargs)
        self.blocks.append(self.executor.runner.kv_cache.stats().used_blocks)
        return out


def measure(args: argparse.Namespace, device: torch.device, n: int, shared: bool) -> dict:
    executor = build(device, args, max(n, 1))
    counted = Counted(executor)
    prompt = [(31 * i + 7) % 1000 + 3 for i in range(args.prompt_len)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    try:
        ids = (
            executor.enqueue_choices(prompt, params, n)
            if shared
            else [executor.enqueue(prompt, params) for _ in range(n)]
        )
        executor._loop.step_here()  # the prefill step (the whole prompt fits one step's 4096 tokens)
        after_prefill = executor.runner.kv_cache.stats().used_blocks
        shared_blocks = executor.runner.kv_cache.shared_blocks()
        outputs = [executor.await_response(i, timeout=600).token_ids for i in ids]
    finally:
        executor.shutdown()
    return {
        "n": n,
        "way": "choices" if shared else "separate",
        "prefill_tokens": counted.tokens - n * (args.max_tokens - 1),
        "blocks_after_prefill": after_prefill,
        "blocks_peak": max(counted.blocks),
        "blocks_shared": shared_blocks,
        "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    report = report_header("choices_kv", argv, device)
    report.update(prompt_len=args.prompt_len, max_tokens=args.max_tokens, tokens_per_block=args.tpb, runs=[])
    for n in (int(v) for v in args.n.split(",")):
        together, apart = measure(args, device, n, True), measure(args, device, n, False)
        same = together.pop("outputs") == apart.pop("outputs")
        report["runs"] += [{**together, "same_outputs_as_separate": same}, apart]
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
