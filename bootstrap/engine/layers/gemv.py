"""A linear layer's product for a few rows, as a Triton kernel that streams the weight once.

At decode batch sizes a projection is a read of its weight: one to a few rows of input against
millions of weights. cuBLAS takes the same time for 1 row as for 16, and on the H200 it runs a
1B model's small matrices well above the time their bytes take (q/k/v: 6.4 µs against 2.6; o:
6.0 against 1.7; down: 13.5 against 7, split-K with its own reduce kernel), which makes a draft
model's passes, and a speculative step at batch 1, slower than the bandwidth allows.

Here each program owns ``BLOCK_N`` output columns and one of ``split`` interleaved runs of the
input dimension; it streams its weight tiles once and keeps every row's partial sums in float32
(rows padded to ``BLOCK_M``, each a product of ``tl.sum``, no tensor cores needed at this size).
With one run the program writes the output (bias added, rounded to the dtype); with several it
writes float32 partials and ``_reduce_kernel`` sums them. ``choose`` picks the tile and the
number of runs on the host from the shape alone, so a CUDA graph keeps them fixed; the numbers
come from ``benchmarks/gemv.py``. ``usable`` says when the layers take this path: Triton
imported, CUDA, half-precision weights, at most ``MAX_ROWS`` rows, and a CUDA graph being
captured (eager, torch's cuBLAS call costs the host less than a Triton launch, and the
replays are where decode spends its time).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from bootstrap.engine import triton_start

triton_start.wait()  # a thread may be importing Triton (``triton_start``): never two threads at once
try:  # an optional dependency: CPU builds of torch come without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_ROWS = 8
MAX_SPLIT = 8
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Tile:
    """One launch's shape: ``block_n`` output columns and ``block_k`` inputs per step, the input
    dimension split in ``split`` interleaved runs, ``warps`` warps a program."""

    block_n: int
    block_k: int
    split: int
    warps: int = 4
    dot: bool = False


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` takes this kernel (see the module's docstring)."""
    return (
        triton is not None
        and x.is_cuda
        and weight.dtype in HALF_DTYPES
        and x.dtype == weight.dtype
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.stride(1) == 1
    )


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        X, W, Bias, Out, Partial, M, N, K, split, stride_xm, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
        SPLIT: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        run = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        if DOT:  # rows padded to 16 for the tensor cores; float32 sums
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:  # each thread's products summed in registers, reduced across threads once at the end
            wide = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(run * BLOCK_K, K, split * BLOCK_K):
            k = k0 + kk
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
            if DOT:
                acc += tl.dot(x, tl.trans(w))
            else:
                wide += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        if not DOT:
            acc = tl.sum(wide, axis=2)
        mask = (m < M)[:, None] & (n < N)[None, :]
        if SPLIT:
            tl.store(Partial + (run * M + m[:, None]) * N + n[None, :], acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(Out + m[:, None] * stride_om + n[None, :], acc.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _reduce_kernel(Partial, Bias, Out, M, N, split, stride_om, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
        row = tl.program_id(0)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for run in range(split):
            acc += tl.load(Partial + (run * M + row) * N + n, mask=n < N, other=0.0)
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_om + n, acc.to(Out.dtype.element_ty), mask=n < N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tile: Tile | None = None) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ weight[N, K].T (+ bias)`` as ``[M, N]`` in ``x``'s dtype; ``tile`` None:
    ``choose``'s for this shape and device."""
    rows, k = x.shape
    n = weight.shape[0]
    tile = tile or choose(rows, n, k, streaming_multiprocessors(x.device))
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    partial = out  # unread with one run
    if tile.split > 1:
        partial = torch.empty(tile.split, rows, n, dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else out
    _gemv_kernel[(triton.cdiv(n, tile.block_n), tile.split)](
        x, weight, bias_arg, out, partial, rows, n, k, tile.split, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=16 if tile.dot else triton.next_power_of_2(rows), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        HAS_BIAS=bias is not None, SPLIT=tile.split > 1, DOT=tile.dot, num_warps=tile.warps,
    )  # fmt: skip
    if tile.split > 1:
        _reduce_kernel[(rows, triton.cdiv(n, 1024))](
            partial, bias_arg, out, rows, n, tile.split, out.stride(0), BLOCK=1024, HAS_BIAS=bias is not None,
            num_warps=4,
        )  # fmt: skip
    return out


def choose(rows: int, n: int, k: int, sms: int) -> Tile:
    """The tile for ``rows`` rows of a ``[n, k]`` weight on a device of ``sms`` multiprocessors:
    up to 2 rows, products summed per thread (8 columns, 512 inputs a step); more, ``tl.dot``
    on rows padded to 16 (32 columns, 128 inputs a step). The input dimension is split in
    enough runs for about four programs per multiprocessor, each run at least four steps long."""
    block_n, block_k, dot = (32, 128, True) if rows > 2 else (8, 512, False)
    programs = -(-n // block_n)
    split = max(1, min(4 * sms // programs, k // (4 * block_k), MAX_SPLIT))
    return Tile(block_n, block_k, split, 4, dot)


@functools.cache
def streaming_multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (Triton's interpreter on the CPU: a fixed 4)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
