"""Optional stage ``warmup`` (between ``final_build`` and ``scheduler_sampler``): capture the decode
steps as CUDA graphs, one per batch-size and width bucket, on the final KV pool.

Here rather than inside ``scheduler_sampler``: capture is the one step of executor creation that
can run out of memory after ``final_build`` filled the device, and it can adapt (fewer buckets)
where a started executor cannot be retried; as its own stage it gets its own span (duration,
memory before and after, what was captured) and rollback. Its memory was estimated by
``profiling`` (one eager decode step of the largest bucket on the probe, plus what each graph
adds) and reserved by ``capacity``, so the first attempt fits; the span records the measured
bytes next to the reserve; an OOM anyway (fragmentation, another process) rolls the capture back and
retries with the smaller half of the batch sizes; every rank of a tensor-parallel run captures the
same buckets (docs/tensor-parallel.md). Skipped, reason ``disabled`` with ``cuda_graphs`` off,
``cpu`` on a CPU device, ``unsupported`` on a backend that captures nothing in this stage (the
simulated GPU; TensorRT-LLM, which captures inside its own executor creation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bootstrap.backends.artifacts import FinalBuild, LoadedModel, ResolvedClasses, Warmup
from bootstrap.backends.base import Backend, CapturesGraphs
from bootstrap.capacity import CapacityPlan
from bootstrap.capacity.cuda_graph_buckets import fewer_batch_sizes, graph_batch_sizes
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline.stage import Adaptation, GiveUp, Skip, Stage, on_oom
from bootstrap.pipeline.undo import Undo


def warmup(
    config: BootstrapConfig,
    resolved: ResolvedClasses,
    loaded: LoadedModel,
    final: FinalBuild,
    plan: CapacityPlan,
    backend: CapturesGraphs,
    undo: Undo,
    batch_sizes: tuple[int, ...] | None = None,
) -> Warmup:
    """``batch_sizes``: set by the OOM adaptation; None, the configured or default buckets. Runs
    only on a backend that ``CapturesGraphs`` (``skip_warmup`` decides)."""
    sizes = tuple(batch_sizes or graph_batch_sizes(config.max_batch_size, config.cuda_graph_batch_sizes))
    return backend.capture_graphs(loaded, resolved, final, plan, config, sizes, undo)


def skip_warmup(config: BootstrapConfig, backend: Backend, **_: Any) -> Skip | None:
    if not config.cuda_graphs:
        return Skip(Warmup(), "disabled")
    if backend.device.kind == "cpu":
        return Skip(Warmup(), "cpu")
    if not isinstance(backend, CapturesGraphs):
        return Skip(Warmup(), "unsupported")
    return None


def fewer_buckets(exc: BaseException, inputs: Mapping[str, Any]) -> Adaptation:
    config: BootstrapConfig = inputs["config"]
    sizes = inputs.get("batch_sizes") or graph_batch_sizes(config.max_batch_size, config.cuda_graph_batch_sizes)
    fewer = tuple(fewer_batch_sizes(sizes))
    if len(fewer) == len(sizes):
        raise GiveUp(
            f"capturing the CUDA graph of batch size {fewer[0]} alone still runs out of memory; "
            "start with --no-cuda-graphs (cuda_graphs=False), or leave more memory beside the KV cache (a lower "
            "free_gpu_memory_fraction or a larger kv_headroom_bytes)"
        ) from exc
    return Adaptation({"batch_sizes": fewer}, {"cuda_graph_batch_sizes": f"{list(sizes)} -> {list(fewer)}"})


def _figures(w: Warmup) -> dict[str, Any]:
    return {
        "bootstrap.warmup.graphs": w.num_graphs,
        "bootstrap.warmup.batch_sizes": list(w.batch_sizes),
        "bootstrap.warmup.widths": list(w.widths),
        "bootstrap.warmup.graph_bytes": w.graph_bytes,
        "bootstrap.warmup.reserved_bytes": w.reserved_bytes,
        "bootstrap.warmup.capture_s": round(w.capture_s, 4),
    }


STAGE = Stage(
    "warmup",
    warmup,
    provides="warmup",
    retry=on_oom(attempts=3),
    adapt=fewer_buckets,
    skip=skip_warmup,
    oom_advice="Capturing the CUDA graphs does not fit beside the KV pools: use --no-cuda-graphs or fewer "
    "--cuda-graph-batch-sizes, or leave more memory beside the KV cache (a lower free_gpu_memory_fraction or a "
    "larger kv_headroom_bytes).",
    figures=_figures,
)
