"""``NativeBackend``: the backend protocol over this package's own engine (``bootstrap.engine``).

The stages decide sizes and retries; this module does the torch work on the device thread and
pushes the release of all it allocates on the attempt's ``Undo`` (``docs/stages.md``).
``load_model`` (``loading``, read in the background; progress lines on stderr, rank 0 only),
released by moving every parameter to ``meta``; ``estimation_build``: probe pools, a
temporary executor on each; ``profiling``: the dummy requests (``executor.profile_run``) and with
a draft one rehearsed speculative step, every figure read from the device port once torch's
cached blocks are returned (else they would count twice, as non-torch memory), the graphs'
memory estimated (``capture``); ``final_build``: the final pools; ``warmup``: the runners and
their CUDA graphs; ``scheduler_sampler``: the ``PyExecutor``, its worker, one smoke request. A
draft goes through each like the target. Each process is one rank of tensor parallelism: its
shard of the weights, ``kv_heads / N`` heads a token per pool. Pools store every layer at full
length (windows as masks), so the shape reported has no windows: every layer priced in full.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from bootstrap.backends.artifacts import EstimationBuild, FinalBuild, LoadedModel, ResolvedClasses, Warmup
from bootstrap.backends.native import capture, early_compile
from bootstrap.backends.native.builds import NativeBuild, NativeModels
from bootstrap.backends.native.headroom import headroom_terms
from bootstrap.backends.native.live_weights import LiveWeights
from bootstrap.backends.native.loading import KV_DTYPES, Loading
from bootstrap.backends.native.placement import device_for, rank_device, rank_env
from bootstrap.backends.native.resolving import Resolving
from bootstrap.capacity import CapacityPlan, MemoryProfile, dummy_request_lengths
from bootstrap.capacity.cuda_graph_buckets import graph_batch_sizes
from bootstrap.capacity.split import PoolBudgets
from bootstrap.config import BootstrapConfig
from bootstrap.devices import Device
from bootstrap.engine.executor.create import create_executor
from bootstrap.engine.executor.profile_run import rehearse_speculation, run_dummy_requests
from bootstrap.engine.executor.py_executor import PyExecutor
from bootstrap.engine.kernels import paged_kv
from bootstrap.engine.kv_cache import KVCacheSpec, PagedKVCache
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.engine.scheduler import SchedulerConfig
from bootstrap.engine.sources.progress_lines import Progress, quiet, to_stderr
from bootstrap.engine.spec.rows import graph_sizes, max_rows
from bootstrap.engine.step.graphs import release_workspaces
from bootstrap.engine.step.model_runner import Lockstep, ModelRunner
from bootstrap.pipeline.collective import Collective
from bootstrap.pipeline.undo import Undo

SMOKE_TIMEOUT_S = 300.0

log = logging.getLogger(__name__)


class NativeBackend(Resolving, Loading, LiveWeights):
    """The backend protocol over ``bootstrap.engine`` (see the module docstring)."""

    name = "native"
    kv_manager = "PagedKVCache"

    def __init__(
        self,
        device: Device,
        torch_device: torch.device,
        cache_dir: Path | None = None,
        collective: Collective | None = None,
        progress: Progress | None = None,
    ) -> None:
        """``progress``: where the loader's first-use steps report; default stderr, on rank 0 only."""
        self.device = device
        self.torch_device = torch_device
        self.cache_dir = cache_dir
        self.collective = collective  # several ranks: the pipeline agrees every attempt through it
        self.tp = collective.world_size if collective is not None else 1
        if progress is None:
            progress = to_stderr if collective is None or collective.rank == 0 else quiet
        self.progress = progress
        self._tokenizers: dict[Path, Any] = {}  # by directory: loaded by resolve_classes, taken by load_model
        self.lockstep: Lockstep | None = None  # serve --tp N, rank 0: the executors it starts lead the ranks

    @classmethod
    def for_config(
        cls, config: BootstrapConfig, cache_dir: Path | None = None, collective: Collective | None = None
    ) -> NativeBackend:
        """At ``tensor_parallel_size`` > 1 this process is one rank (``bootstrap.pipeline.collective``):
        ``collective`` given, or joined here from the launcher's ``RANK`` / ``WORLD_SIZE``. On one
        CUDA device, the target's kernels begin compiling now (``early_compile``)."""
        if config.tensor_parallel_size == 1:
            device, torch_device = device_for(config.device)
            early_compile.begin_for(config, torch_device)  # the kernels' first compile, before any stage
            return cls(device, torch_device, cache_dir=cache_dir)
        env = rank_env(config)
        device, torch_device = device_for(rank_device(config.device, env.local_rank))
        if collective is None:
            from bootstrap.parallel.torch_dist import init_ranks

            collective = init_ranks(env, torch_device.type)
        return cls(device, torch_device, cache_dir=cache_dir, collective=collective)

    def kv_caps(self, resolved: ResolvedClasses, config: BootstrapConfig) -> dict[str, int]:
        """Extra caps on the KV budget, in bytes, by name (``limited_by``). On the CPU: what
        ``max_batch_size`` requests of ``max_seq_len`` can ever use, so a laptop's memory is not
        planned for a cache that no schedule could fill (a GPU is filled, as its peers do)."""
        if self.device.kind != "cpu":
            return {}
        blocks = -(-resolved.max_seq_len // config.tokens_per_block) * config.max_batch_size
        return {"max_batch_size": resolved.total_cost.bytes_for_tokens(blocks * config.tokens_per_block)}

    def default_headroom_bytes(
        self, profile: MemoryProfile | None, resolved: ResolvedClasses, config: BootstrapConfig
    ) -> int | None:
        """On CUDA with the Triton paged decode kernel, ``headroom``'s bound; else None."""
        if self.torch_device.type != "cuda" or not paged_kv.available(self.torch_device, config.tokens_per_block):
            return None
        return headroom_terms(profile, resolved, config)["total"]

    # ---- the allocator's cache, after a release ----------------------------------------------

    def _return_cached(self) -> None:
        """Torch's cached blocks back to the device, after the work queued so far; cuBLAS
        workspaces too when no CUDA graph is alive (``release_workspaces``)."""
        self.device.synchronize()
        if self.torch_device.type == "cuda":
            release_workspaces()
        self.device.empty_cache()

    def _settler(self) -> Callable[[], None]:
        """An undo entry that returns the allocator's cache once everything pushed after it is
        released, with a full garbage collection only if bytes are still allocated beyond what
        was allocated now once the cuBLAS workspaces are freed too: a reference cycle (a failed
        attempt's traceback) holds tensors. A full collection walks every Python object (a
        quarter of a second with torch and transformers loaded), so a clean release, the common
        case, must not pay for one (a capture's workspace alone made every release pay)."""
        baseline = self.device.allocated_bytes()

        def settle() -> None:
            self._return_cached()
            if self.device.allocated_bytes() > baseline:
                gc.collect()
                self._return_cached()

        return settle

    # ---- estimation_build and profiling -------------------------------------------------------

    def estimation_overhead_bytes(self, resolved: ResolvedClasses, config: BootstrapConfig) -> int:
        """Each probe executor's decode buffers: seven int64 rows of its ``max_rows`` and the
        static-width block tables (``ModelRunner``'s ``DecodeBuffers``; their pinned host copies
        are host memory); the sampler keeps none. What a graph capture adds is measured by
        ``profile`` (``graph_bytes``)."""
        blocks = -(-resolved.max_seq_len // config.tokens_per_block)
        return sum(8 * rows * (7 + blocks) for rows in max_rows(config).values())

    def build_estimation(
        self, loaded: LoadedModel, resolved: ResolvedClasses, probe_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> EstimationBuild:
        models: NativeModels = loaded.handle
        self._await_weights(loaded)  # the probe's forwards need the values
        pools = self._pools(
            dict.fromkeys(models.by_name(), probe_tokens), models, resolved, undo, PagedKVCache.from_tokens
        )
        scheduler = SchedulerConfig(config.max_batch_size, config.max_num_tokens, resolved.max_seq_len)
        executors = {}
        rows = max_rows(config)
        for name, weights in models.by_name().items():
            runner = ModelRunner(
                weights.model, pools[name], config.max_batch_size, resolved.max_seq_len, max_rows=rows[name]
            )
            executors[name] = create_executor(
                weights.model,
                pools[name],
                scheduler,
                weights.tokenizer,
                set(weights.eos_token_ids),
                start=False,
                runner=runner,
            )
            undo.push(executors[name].shutdown)
        probe_bytes = sum(p.stats().total_bytes for p in pools.values())
        return EstimationBuild(
            NativeBuild(pools, executors), pools["target"].stats().capacity_tokens, probe_bytes, config.max_num_tokens
        )

    def profile(
        self, estimation: EstimationBuild, loaded: LoadedModel, max_num_tokens: int, config: BootstrapConfig, undo: Undo
    ) -> MemoryProfile:
        """Peak reset, the dummy requests through every probe executor, figures after."""
        device, build = self.device, estimation.handle
        lengths = dummy_request_lengths(max_num_tokens, loaded.handle.max_seq_len)
        self._return_cached()
        device.reset_peak()
        before, free_before = device.allocated_bytes(), device.free_bytes()
        for executor in build.executors.values():  # one after the other: the peak is the larger
            run_dummy_requests(executor, lengths)
        if "draft" in build.executors:
            rehearse_speculation(build.executors, config, loaded.handle.max_seq_len)
        device.synchronize()
        torch_peak, torch_used = device.peak_bytes(), device.allocated_bytes()
        self._return_cached()  # torch's cached blocks back first: "used - torch_used" is memory outside torch
        figures = dict(
            total_bytes=device.total_bytes(),
            free_before_bytes=free_before,
            model_bytes=max(before - estimation.probe_kv_bytes, 0),
            torch_peak_bytes=torch_peak,
            torch_used_bytes=torch_used,
            used_bytes=device.total_bytes() - device.free_bytes(),
            probe_kv_bytes=estimation.probe_kv_bytes,
            max_num_tokens=max_num_tokens,
        )
        graph_bytes = 0
        if self._captures(config):
            sizes = graph_sizes(config, graph_batch_sizes(config.max_batch_size, config.cuda_graph_batch_sizes))
            graph_bytes = capture.reserve_bytes(build.executors, sizes, self._return_cached)
        return MemoryProfile(**figures, graph_bytes=graph_bytes)

    def _captures(self, config: BootstrapConfig) -> bool:
        return config.cuda_graphs and self.torch_device.type == "cuda"  # as skip_warmup

    # ---- final_build and scheduler_sampler ----------------------------------------------------

    def build_final(
        self, loaded: LoadedModel, resolved: ResolvedClasses, budgets: PoolBudgets, undo: Undo
    ) -> FinalBuild:
        wanted = {p.name: p.gpu_bytes for p in budgets.pools()}
        pools = self._pools(wanted, loaded.handle, resolved, undo, PagedKVCache.from_bytes)
        for name, pool in pools.items():
            if pool.quantized:
                log.info(
                    "KV cache %s in fp8: per-layer scales %s", name, loaded.handle.by_name()[name].kv_scales.source
                )
        return FinalBuild(
            handle=NativeBuild(pools),
            kv_scales=loaded.handle.target.kv_scales if pools["target"].quantized else None,
            pool_bytes={n: p.stats().total_bytes for n, p in pools.items()},
            pool_tokens={n: p.stats().capacity_tokens for n, p in pools.items()},
        )

    def capture_graphs(
        self,
        loaded: LoadedModel,
        resolved: ResolvedClasses,
        final: FinalBuild,
        plan: CapacityPlan,
        config: BootstrapConfig,
        batch_sizes: tuple[int, ...],
        undo: Undo,
    ) -> Warmup:
        """The target's runner on its final pool, its decode steps captured for ``batch_sizes``
        (every width bucket), and with a draft its verify passes too, and the draft's runner on
        its pool with its passes captured (``graph_sizes``), by ``native.capture``."""
        rows, sizes = max_rows(config), graph_sizes(config, batch_sizes)
        runners = {
            name: ModelRunner(
                weights.model,
                final.handle.pools[name],
                config.max_batch_size,
                resolved.max_seq_len,
                max_rows=rows[name],
            )
            for name, weights in loaded.handle.by_name().items()
        }
        return capture.capture(runners, sizes, plan, self.device, self._return_cached, self._settler(), undo)

    def start_executor(
        self,
        loaded: LoadedModel,
        resolved: ResolvedClasses,
        final: FinalBuild,
        plan: CapacityPlan,
        config: BootstrapConfig,
        undo: Undo,
        warmup: Warmup | None = None,
    ) -> PyExecutor:
        """With a ``warmup`` that captured graphs, its runner (and graphs) serve the executor,
        once every weight is read."""
        self._await_weights(loaded)
        target = loaded.handle.target
        for name, weights in loaded.handle.by_name().items():  # new weights may have brought new scales
            if final.handle.pools[name].quantized:
                final.handle.pools[name].take_scales(weights.kv_scales.keys, weights.kv_scales.values)
        overlap = config.overlap and self.torch_device.type == "cuda"  # a CPU step is done when launched
        scheduler = SchedulerConfig(
            config.max_batch_size, plan.max_num_tokens, resolved.max_seq_len, config.prefix_caching, overlap
        )
        runners = warmup.handle if warmup is not None and warmup.handle is not None else {}
        runner, draft = runners.get("target"), loaded.handle.draft
        drafted = runners.get("draft") or ((draft.model, final.handle.pools["draft"]) if draft is not None else None)
        executor = create_executor(
            target.model,
            final.handle.pools["target"],
            scheduler,
            target.tokenizer,
            set(target.eos_token_ids),
            start=False,
            runner=runner,
            draft=drafted,
            speculative_tokens=config.speculative_tokens or 1,
            adaptive=config.num_speculative_tokens == "auto",
        )
        undo.push(executor.shutdown, keep_pool=True)  # the pools and graphs are final_build's and warmup's
        executor.start_worker()
        serve_smoke_request(executor)  # every rank its own, before its runner leads or follows
        if self.lockstep is not None:
            executor.runner.lead(self.lockstep)
            if executor.speculator is not None:
                executor.speculator.draft.lead(self.lockstep, "draft")
        return executor

    # ---- helpers ------------------------------------------------------------------------------

    def _pools(
        self,
        sizes: Mapping[str, int],
        models: NativeModels,
        resolved: ResolvedClasses,
        undo: Undo,
        make: Callable[..., PagedKVCache],
    ) -> dict[str, PagedKVCache]:
        """One pool per model, ``make(spec, sizes[name], ...)``; each release pushed at once."""
        pools: dict[str, PagedKVCache] = {}
        weights = models.by_name()
        undo.push(self._settler())  # last in the rollback: the allocator's cache goes back to the device
        for name, size in sizes.items():
            spec = KVCacheSpec.from_config(weights[name].hf_config, KV_DTYPES[resolved.kv_dtype], tp=self.tp)
            pools[name] = pool = make(spec, size, models.tokens_per_block, self.torch_device)
            undo.push(pool.release)
            if pool.quantized:
                pool.take_scales(weights[name].kv_scales.keys, weights[name].kv_scales.values)
        return pools


def serve_smoke_request(executor: PyExecutor) -> None:
    """One request through the started worker: prompt of one token, one token generated."""
    rid = executor.enqueue([0], SamplingParams(max_tokens=1, ignore_eos=True), is_warmup=True)
    response = executor.await_response(rid, SMOKE_TIMEOUT_S)
    if response.finish_reason not in ("length", "stop"):
        raise RuntimeError(f"the smoke request failed ({response.finish_reason}): {response.error}")
