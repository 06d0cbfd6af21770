"""Decode steps captured as CUDA graphs: one graph per (batch size, block-table width) bucket
(captured by the ``warmup`` stage: ``docs/cuda-graphs.md``).

A graph replays fixed shapes at fixed addresses, so every input of a decode step lives in the
runner's static ``DecodeBuffers`` and attention reads them through ``DecodeMetadata``. A step of
``n`` rows whose longest block table has ``w`` blocks replays the smallest captured bucket
covering both; rows past ``n`` repeat the last request (logits dropped, KV writes its own),
columns past each table are masked; steps no bucket covers run eagerly. Batch sizes: 1, 2, 4, 8,
then every multiple of 8 up to ``max_batch_size``, with a draft the verify pass's rows too
(``bootstrap.capacity.cuda_graph_buckets``). Widths: with the Triton paged kernel one, the whole
table (the kernel stops at each row's length); with the gathering attention, doubling from the
blocks of 256 tokens up to ``min(max_seq_len, CUDA_GRAPH_MAX_SEQ_LEN)`` (it reads its whole
width; one for 131,072 tokens would need gigabytes of gather buffers per layer). How a capture
runs: ``DecodeGraphs.capture``; what it will take, without capturing: ``capture_reserve_bytes``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bootstrap.devices import is_oom
from bootstrap.engine.step.decode_step import DecodeRunner, DecodeStep

MiB = 1024**2
# What a capture holds besides one eager step's working memory and the logits buffer, outside
# torch's allocator: a fixed part (the capture stream's cuBLAS workspace, the compiled norms' and
# Triton's kernels, the driver's graph state) and a part per graph. Calibrated on the H200 with a
# margin over both (benchmarks/README.md, "Calibration constants in the code").
CAPTURE_FIXED_BYTES = 128 * MiB
GRAPH_EXEC_BYTES = 4 * MiB  # per captured graph: its executable graph, and any growth of the shared pool

_live: weakref.WeakSet[DecodeGraphs] = weakref.WeakSet()  # captures not yet released, in this process
_live_lock = threading.Lock()


@dataclass(frozen=True)
class GraphCapture:
    """What ``DecodeGraphs.capture`` captured."""

    batch_sizes: tuple[int, ...]  # ascending
    widths: tuple[int, ...]  # block-table columns, ascending
    num_graphs: int
    seconds: float


class DecodeGraphs:
    """The captured decode graphs of one ``ModelRunner`` (a ``DecodeRunner``) (see the module docstring)."""

    def __init__(self, runner: DecodeRunner) -> None:
        if runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this runner is on {runner.device}")
        self.runner = runner
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(
            runner.device
        )  # every warm-up run and capture: one stream, one cuBLAS workspace
        self.batch_sizes: tuple[int, ...] = ()
        self.widths: tuple[int, ...] = ()
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None

    def capture(self, batch_sizes: Sequence[int], widths: Sequence[int]) -> GraphCapture:
        """Capture every (batch size, width) bucket, largest first, all into one memory pool:
        the graphs never run at once, so a later capture reuses what an earlier one freed and the
        pool grows to about the largest graph's working memory. Each graph copies its logits into
        one shared static buffer. The first bucket, and the one-row bucket (the compiled norms
        specialize a size of one), run once eagerly before their capture (lazy initialisation:
        the cuBLAS handle and workspace, Triton's and the compiled norms' kernels); the others need
        no eager run, which shortens the capture. One side stream for every capture: torch keeps a
        cuBLAS workspace (32 MiB on Hopper) per stream that ran a GEMM. The dummy inputs write
        block 0, so the KV pool must be empty. An out-of-memory error inside a capture is re-raised
        as itself, not as the capture-invalidated error CUDA reports next, so a caller can retry
        with fewer buckets."""
        runner = self.runner
        sizes, widths = (
            self._checked(batch_sizes, runner.max_rows, "batch size"),
            self._checked(widths, runner.max_blocks_per_seq, "width"),
        )
        if runner.kv_cache.stats().used_blocks:
            raise RuntimeError("CUDA graphs are captured on an empty KV pool (the dummy steps write block 0)")
        start = time.perf_counter()
        with _live_lock:
            _live.add(self)
        self._logits = torch.empty(sizes[-1], runner.vocab_size, dtype=_logits_dtype(runner), device=runner.device)
        runner.decode_buffers.fill(DecodeStep.dummy(sizes[-1]), sizes[-1], widths[-1])
        with torch.inference_mode():
            for rows in reversed(sizes):
                for width in reversed(widths):
                    warm_up = not self._graphs or rows == 1  # the first capture; one row: its own specialization
                    self._graphs[(rows, width)] = self._capture_one(rows, width, warm_up)
        torch.cuda.synchronize(runner.device)
        self.batch_sizes, self.widths = tuple(sizes), tuple(widths)
        return GraphCapture(self.batch_sizes, self.widths, len(self._graphs), time.perf_counter() - start)

    @staticmethod
    def _checked(values: Sequence[int], limit: int, what: str) -> list[int]:
        values = sorted(set(values))
        if not values or values[0] < 1 or values[-1] > limit:
            raise ValueError(f"CUDA graph {what}s must be integers in [1, {limit}], got {list(values)}")
        return values

    def _capture_one(self, rows: int, width: int, warm_up: bool) -> torch.cuda.CUDAGraph:
        assert self._logits is not None
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        if warm_up:
            with torch.cuda.stream(stream):  # an eager run off the capture
                self.runner.forward_decode(rows, width)
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                self._logits[:rows].copy_(self.runner.forward_decode(rows, width))
        except Exception as exc:
            root = _root_oom(exc)
            if root is exc:
                raise
            raise root from None
        return graph

    def bucket(self, size: int, width: int) -> tuple[int, int] | None:
        """The smallest captured (batch size, width) covering a step, or None (run eagerly)."""
        rows = next((b for b in self.batch_sizes if b >= size), None)
        cols = next((w for w in self.widths if w >= width), None)
        return None if rows is None or cols is None else (rows, cols)

    def replay(self, bucket: tuple[int, int]) -> torch.Tensor:
        """Replay a bucket over the buffers as filled; its logits ``[rows, vocab]`` (a view of a
        shared buffer, valid until the next replay)."""
        self._graphs[bucket].replay()
        assert self._logits is not None
        return self._logits[: bucket[0]]

    def release(self) -> None:
        """Drop every graph, the logits buffer and the pool (idempotent)."""
        self._graphs.clear()
        self._logits = None
        self.batch_sizes, self.widths = (), ()
        with _live_lock:
            _live.discard(self)


def release_workspaces() -> bool:
    """Free torch's cuBLAS workspaces (32 MiB on Hopper per thread and stream that ran a GEMM:
    the capture stream, the executor's worker thread), unless a capture of this module is alive:
    its graphs replay GEMMs into the workspace they were captured with, so freeing it under them
    would corrupt memory or fault. True when freed. A GEMM after this allocates a fresh one."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    with _live_lock:
        if _live or clear is None or not torch.cuda.is_initialized():
            return False
        torch.cuda.synchronize()
        clear()
    return True


def capture_reserve_bytes(runner: DecodeRunner, batch_sizes: Sequence[int]) -> tuple[int, dict[str, int]]:
    """Device bytes capturing ``batch_sizes`` on ``runner`` will take, without capturing (which
    takes about as long as the capture itself): one eager decode step of the largest bucket, its
    peak allocation above what was allocated before (the shared pool grows to about the largest
    graph's working memory; the eager step's norms are not compiled yet, so it allocates more
    than the captured step, never less), plus the shared logits buffer, ``CAPTURE_FIXED_BYTES``
    and ``GRAPH_EXEC_BYTES`` per graph. Returns the sum and its terms. Needs an
    empty KV pool (the dummy step writes block 0), like ``DecodeGraphs.capture``."""
    device, sizes = runner.device, sorted(set(batch_sizes))
    rows, width = sizes[-1], runner.default_widths()[-1]
    runner.decode_buffers.fill(DecodeStep.dummy(rows), rows, width)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        runner.forward_decode(rows, width)
    torch.cuda.synchronize(device)
    terms = {
        "step_working": torch.cuda.max_memory_allocated(device) - before,
        "logits": rows * runner.vocab_size * torch.empty((), dtype=_logits_dtype(runner)).element_size(),
        "fixed": CAPTURE_FIXED_BYTES,
        "executables": GRAPH_EXEC_BYTES * len(sizes) * len(runner.default_widths()),
    }
    return sum(terms.values()), terms


def _logits_dtype(runner: DecodeRunner) -> torch.dtype:
    head = runner.model.get_output_embeddings()
    return head.weight.dtype if head is not None else next(runner.model.parameters()).dtype


def _root_oom(exc: BaseException) -> BaseException:
    """The out-of-memory error ``exc`` was raised while handling, if any (CUDA reports a failed
    capture as invalidated once the OOM inside it has ended the capture); else ``exc``."""
    seen: BaseException | None = exc
    while seen is not None:
        if is_oom(seen):
            return seen
        seen = seen.__context__
    return exc
