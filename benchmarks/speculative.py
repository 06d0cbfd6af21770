"""Speculative decoding's throughput against decoding without the draft, at a chosen acceptance.

One bootstrap (the real stages) of ``--model`` with ``--draft-model`` builds the executor; the
baseline is the same executor with its speculator switched off (the target alone, through its
CUDA graphs), so both run on the same weights and pools, side by side, one right after the other.

Real drafts with real acceptance cannot run here (random weights agree with nothing), so the
acceptance is controlled: the draft runs its ``k`` passes as usual (its cost is real), then each
proposal is replaced by the target's own greedy continuation (recorded from a baseline run, then
recorded again through the verify pass: ``calibrated``) with probability ``--acceptance``, else
by another token, one draw per request and output position (``Controlled``). With greedy
verification a proposal is then kept exactly when it and every one before it are the target's, so
the acceptance per position is the chosen rate. Both paths run once at each batch size before it
is timed (first-use kernel compilation is not counted; ``auto`` has then measured its passes).
Each point: ``batch`` requests of ``--prompt-len`` random tokens, ``--gen-len`` greedy tokens
each; tokens per second of the whole batch, speculative against
baseline, and the analytic expectation ``(1 - a^(k+1)) / (1 - a) / (1 + c k)`` for acceptance
``a`` and the draft's cost ``c`` (its weight bytes over the target's), and the same from the
passes' measured seconds (``expected_speedup_measured_costs``), and where the speculative run's
time went: its speculative and ordinary steps, counted and timed on the host (``StepTimes``).
``auto`` runs at acceptance 0 too: what a draft that never agrees costs once ``auto`` stops
speculating.

    python benchmarks/speculative.py --model /tmp/llama-8b --draft-model random:llama-3.2-1b --device cuda \\
        --batches 1,8,32 --acceptance 0,0.5,0.7,0.9,1.0 --k 4 --out speculative.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common, also when loaded by path
from bench_common import emit  # noqa: E402

from bootstrap import BootstrapConfig  # noqa: E402
from bootstrap.api import Bootstrap  # noqa: E402
from bootstrap.engine import SamplingParams  # noqa: E402
from bootstrap.engine.spec.depth import StepCosts, best_depth, expected_tokens  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft-model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--acceptance", default="0,0.5,0.7,0.9,1.0")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--modes", default="fixed,auto", help="fixed (k = --k), auto, or both")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def expected_speedup(rate: float, k: int, cost: float) -> float:
    return expected_tokens(rate, k) / (1.0 + cost * k)


def measured_expectation(rate: float, speculator, decode_s: float) -> float:
    """The same expectation from measured seconds: ``decode_s``, the baseline's step (its wall
    time over its tokens per request), and the verify and draft passes as the speculator
    measured them (``StepCosts``); with ``auto``, at the depth it would choose from them."""
    costs = speculator.costs
    k = best_depth(rate, costs, speculator.k) if speculator.adaptive else speculator.k
    if k == 0 or costs.verify is None or costs.draft is None:
        return 1.0
    return expected_tokens(rate, k) * decode_s / (costs.verify + costs.draft * k)


class Controlled:
    """Replaces the speculator's proposals: the target's recorded continuation with probability
    ``rate``, else another token; the draft's passes still run first. Whether the proposal for a
    request's output position is the right one is fixed per (request, position): one uniform
    draw each, kept below ``rate``. So a run repeats its accepted runs exactly, whatever the
    step boundaries (two commits compare at the same drawn acceptance), and a higher rate keeps
    every position a lower one kept."""

    def __init__(self, speculator, references: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.speculator, self.references, self.vocab = speculator, references, vocab
        self.original = speculator._propose
        self.rate = 1.0
        span = max(len(r) for r in references.values()) + speculator.k + 1
        self.draws = {
            prompt: [rng.random() for _ in range(span)]
            for prompt, rng in ((p, random.Random(i)) for i, p in enumerate(references))
        }
        speculator._propose = self.propose

    def propose(self, seqs, k):
        proposals, q = self.original(seqs, k)
        rows = []
        for seq in seqs:
            prompt, done = tuple(seq.prompt_token_ids), len(seq.output_token_ids)
            ahead, draws = self.references[prompt][done:], self.draws[prompt][done:]
            row = []
            for j in range(k):
                right = ahead[j] if j < len(ahead) else 0
                row.append(right if draws[j] < self.rate else (right + 1) % self.vocab)
            rows.append(row)
        pinned = torch.tensor(rows, dtype=torch.long, pin_memory=proposals.is_cuda)  # queued, not waited for
        return pinned.to(proposals.device, non_blocking=True), q


class StepTimes:
    """Counts and host wall time of the speculator's speculative steps (``step``) and of the
    ordinary steps it is told of (``ordinary``: their run, sampling included), so a point says
    where its time went: ``steps()`` since the last call."""

    def __init__(self, speculator) -> None:
        self.counts = {"speculative": [0, 0.0], "ordinary": [0, 0.0]}
        self._step, self._ordinary = speculator.step, speculator.ordinary
        speculator.step, speculator.ordinary = self.step, self.ordinary

    def step(self, batch, limits):
        started = time.perf_counter()
        try:
            return self._step(batch, limits)
        finally:
            self._add("speculative", time.perf_counter() - started)

    def ordinary(self, batch, seconds):
        self._add("ordinary", seconds)
        return self._ordinary(batch, seconds)

    def _add(self, kind: str, seconds: float) -> None:
        self.counts[kind][0] += 1
        self.counts[kind][1] += seconds

    def steps(self) -> dict:
        out = {f"{kind}_steps": n for kind, (n, _) in self.counts.items()}
        out.update({f"{kind}_step_ms": round(s / n * 1e3, 3) if n else None for kind, (n, s) in self.counts.items()})
        self.counts = {kind: [0, 0.0] for kind in self.counts}
        return out


def timed(executor, prompts: list[list[int]], gen_len: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    ids = [executor.enqueue(p, params) for p in prompts]
    outs = [executor.await_response(i, timeout=600).token_ids for i in ids]
    return time.perf_counter() - started, outs


def calibrated(executor, control: Controlled, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    """The target's greedy continuation as its verify pass computes it: a speculative run whose
    proposals are all the recorded baseline's, its output the new references, twice. In bfloat16
    the verify pass (``k + 1`` rows a request) and the decode step (one) multiply in other
    orders, so on random weights, whose logits are near ties, their argmaxes part; each
    position's verify logits do not depend on where the step boundaries fall (every step
    replays the same bucket), so references recorded this way are kept as often as asked."""
    loop, references = executor._loop, None
    for _ in range(2):
        control.rate, loop.speculator = 1.0, control.speculator
        _, references = timed(executor, prompts, gen_len)
        control.references = {tuple(p): r for p, r in zip(prompts, references)}
    loop.speculator = None
    return references


def controlled(
    executor, prompts: list[list[int]], gen_len: int
) -> tuple[float, list[list[int]], Controlled, list[list[int]]]:
    """One point's setup: both paths run once at this batch size (kernels compiled, shapes seen),
    the baseline timed, its speculator's proposals put under ``Controlled`` and its references
    calibrated. Returns the baseline's seconds and outputs, the control and the references; the
    speculator is left switched off."""
    speculator, loop = executor.speculator, executor._loop
    for warm in (speculator, None):
        loop.speculator = warm
        timed(executor, prompts, 8)
    base_s, baseline = timed(executor, prompts, gen_len)
    control = Controlled(speculator, {tuple(p): r for p, r in zip(prompts, baseline)}, executor.runner.vocab_size)
    return base_s, baseline, control, calibrated(executor, control, prompts, gen_len)


async def build(args: argparse.Namespace, auto: bool):
    config = BootstrapConfig.parse(
        model=args.model,
        draft_model=args.draft_model,
        device=args.device,
        max_seq_len=args.max_seq_len,
        num_speculative_tokens="auto" if auto else args.k,
        max_batch_size=max(int(b) for b in args.batches.split(",")),
    )
    boot = Bootstrap(config)
    executor = await boot.build()
    return boot, executor


def measure(args: argparse.Namespace, executor, auto: bool) -> list[dict]:
    speculator, loop = executor.speculator, executor._loop
    clock = StepTimes(speculator)
    rng = random.Random(1)
    vocab = executor.runner.vocab_size
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        base_s, baseline, control, references = controlled(executor, prompts, args.gen_len)
        rates = [0.0] if auto else [float(a) for a in args.acceptance.split(",")]
        for rate in rates:
            control.rate = rate
            loop.speculator = speculator
            before = (speculator.stats.proposed, speculator.stats.accepted)
            clock.steps()
            spec_s, outs = timed(executor, prompts, args.gen_len)
            steps = clock.steps()
            loop.speculator = None
            again_s, _ = timed(executor, prompts, args.gen_len)  # the baseline once more, right after
            base = (base_s + again_s) / 2
            proposed, accepted = speculator.stats.proposed - before[0], speculator.stats.accepted - before[1]
            tokens = batch * args.gen_len
            results.append(
                {
                    "batch": batch,
                    "acceptance_set": rate,
                    "auto": auto,
                    "acceptance_measured": round(accepted / proposed, 4) if proposed else None,
                    "speculative_tokens_per_s": round(tokens / spec_s, 1),
                    "baseline_tokens_per_s": round(tokens / base, 1),
                    "speedup": round(base / spec_s, 3),
                    "expected_speedup_measured_costs": round(
                        measured_expectation(rate, speculator, base / args.gen_len), 3
                    ),
                    "expected_speedup": round(expected_speedup(rate, args.k, speculator.cost), 3)
                    if not auto
                    else round(
                        expected_speedup(
                            rate, best_depth(rate, StepCosts(speculator.cost), speculator.k), speculator.cost
                        ),
                        3,
                    ),
                    "outputs_equal": outs == references,
                    "outputs_equal_baseline": outs == baseline,
                    **steps,
                    "costs_ms": {
                        name: round(getattr(speculator.costs, name) * 1e3, 3)
                        if getattr(speculator.costs, name)
                        else None
                        for name in ("decode", "verify", "draft")
                    },
                }
            )
            print(json.dumps(results[-1]), flush=True)
        speculator._propose = control.original
    return results


async def run(args: argparse.Namespace) -> dict:
    out = {}
    for auto in [mode == "auto" for mode in args.modes.split(",")]:
        boot, executor = await build(args, auto)
        try:
            out["auto" if auto else "fixed"] = measure(args, executor, auto)
            out.setdefault("cost_ratio", round(executor.speculator.cost, 4))
            out.setdefault("plan", boot.report().plan)
        finally:
            await boot.aclose()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {
        "command": " ".join(["speculative.py", *(argv if argv is not None else sys.argv[1:])]),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "k": args.k,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        **asyncio.run(run(args)),
    }
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
