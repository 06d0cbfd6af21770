"""Pipeline overhead per stage: one trivial stage per default stage (nine with ``warmup``; eight
when the saved figures were taken) through the pipeline (tracing on, device thread, events)
versus the same calls made directly, side by side in one run.

    python benchmarks/pipeline_overhead.py --repeats 200 --out pipeline_overhead.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import anyio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.devices import FakeDevice
from bootstrap.pipeline import Pipeline
from bootstrap.pipeline.stage import Stage, on_oom
from bootstrap.pipeline.telemetry import make_tracer_provider
from bootstrap.stages import STAGE_IDS


def trivial(previous: int, undo: object = None) -> int:
    return previous + 1


def named_input(name: str):
    """``trivial`` taking its input under ``name``, so the stages chain by artifact names."""

    def body(undo, **inputs):
        return trivial(inputs[name], undo)

    body.__signature__ = inspect.Signature(
        [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY),
            inspect.Parameter("undo", inspect.Parameter.KEYWORD_ONLY),
        ]
    )
    return body


def stage_graph() -> list[Stage]:
    stages = []
    for i, sid in enumerate(STAGE_IDS):
        needs = "seed" if i == 0 else f"out{i - 1}"
        stages.append(Stage(sid, named_input(needs), f"out{i}", retry=on_oom(3)))
    return stages


def direct() -> float:
    start = time.perf_counter()
    value = 0
    for _ in STAGE_IDS:
        value = trivial(value)
    return time.perf_counter() - start


async def through_pipeline(stages: list[Stage], device: FakeDevice) -> float:
    memory = InMemorySpanExporter()
    provider = make_tracer_provider(memory=memory)
    start = time.perf_counter()
    pipeline = Pipeline(stages, {"seed": 0}, tracer_provider=provider, device=device)
    await pipeline.run()
    await pipeline.aclose()
    elapsed = time.perf_counter() - start
    assert len(memory.get_finished_spans()) == 1 + 2 * len(stages)
    return elapsed


async def measure(repeats: int) -> dict:
    stages, device = stage_graph(), FakeDevice(total=1 << 30)
    piped, plain = [], []
    for _ in range(repeats):  # interleaved, so both see the same machine noise
        piped.append(await through_pipeline(stages, device))
        plain.append(direct())
    per_stage = [(p - d) / len(stages) * 1e6 for p, d in zip(piped, plain)]
    return {
        "stages": len(stages),
        "repeats": repeats,
        "pipeline_run_ms_median": statistics.median(piped) * 1e3,
        "direct_run_ms_median": statistics.median(plain) * 1e3,
        "overhead_per_stage_us_median": statistics.median(per_stage),
        "overhead_per_stage_us_p90": statistics.quantiles(per_stage, n=10)[-1],
        "goal_per_stage_us": 2000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("pipeline_overhead.json"))
    args = parser.parse_args()
    result = anyio.run(measure, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
