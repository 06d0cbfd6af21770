"""A linear layer's product for one row, as a Triton kernel that streams the weight once.

At batch 1 a decode step (and each pass of a draft model) multiplies one row by every weight
matrix: a read of the weights. cuBLAS takes as long for that row as for 16, and runs some of
these matrices well above the time their bytes take. Here each program owns ``BLOCK_N`` output
rows of the weight and walks the input dimension ``BLOCK_K`` at a time, each thread keeping its
products in float32 registers and the program summing them across threads once, at the end;
then the bias, and one rounding to the dtype. Measured against cuBLAS per shape
(benchmarks/README.md, "The one-row linear kernel against cuBLAS"): at one row it wins in most
shapes; at two rows or more it lost or tied, so those go to cuBLAS. ``usable`` says when the
layers take this path.
"""

from __future__ import annotations

import torch

from bootstrap.engine.kernels import triton_start

triton_start.wait()  # a thread may be importing Triton (``triton_start``): never two threads at once
try:  # an optional dependency: CPU builds of torch come without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

HALF_DTYPES = (torch.bfloat16, torch.float16)
BLOCK_N = 4
BLOCK_K = 1024


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` takes this kernel: Triton imported, one row of a CUDA tensor,
    half precision (float32 stays on cuBLAS, whose products the parity tests compare), and
    weight rows contiguous."""
    return (
        triton is not None
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and weight.dtype in HALF_DTYPES
        and x.dtype == weight.dtype
        and weight.stride(1) == 1
    )


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        X, W, Bias, Out, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        wide = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # each thread's products, summed across threads once
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
            x = tl.load(X + k, mask=k < K, other=0.0)
            wide += x.to(tl.float32)[None, :] * w.to(tl.float32)
        acc = tl.sum(wide, axis=1)
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(Out + n, acc.to(Out.dtype.element_ty), mask=n < N)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """``x [1, K] @ weight[N, K].T (+ bias)`` as ``[1, N]`` in ``x``'s dtype (``block_n`` and
    ``block_k``: the tile, for the benchmark's sweep)."""
    n, k = weight.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else out,
        out,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out
