"""FP8 projections on CUDA: e4m3 weights with their scales (``layers.fp8``), 16-bit activations
in and out.

One row (a batch-1 decode step, a draft's pass) takes ``one_row``: a Triton kernel that streams
the e4m3 weight once, as ``gemv`` streams a 16-bit one, in a tile per shape (``tile``), the sums
scaled by their row's scale in float32 (block scales: the row's columns by their block's first);
the activation stays 16-bit (weight-only). More rows take
cuBLASLt's FP8 GEMM (``torch._scaled_mm``) on activations quantized per token, or per token and
128 columns for block scales, by ``quantize`` (one Triton kernel); the scales are applied in the
GEMM's epilogue. Block scales need torch's ``scaled_mm`` with ``BlockWise128x128``; where it is
missing (``blockwise_supported``), and for what cuBLASLt does not take (widths not multiples of
16, float16 activations), the product dequantizes the weight first. Measured per
shape and batch: benchmarks/README.md, "FP8 projections".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bootstrap.engine.kernels import triton_start

triton_start.wait()  # never two threads importing Triton at once (``triton_start``)
try:  # an optional dependency: CPU builds of torch come without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # a row of zeros still gets a finite scale
HALF_DTYPES = (torch.bfloat16, torch.float16)
_BLOCKWISE: dict[torch.device, bool] = {}  # ``blockwise_supported``, per device
FEW_ROWS = 16  # rows up to which ``few_rows`` outran the row-scaled GEMM on the H200 (not the block-scaled one)
FEW_ROWS_MAX = 64  # the most rows ``few_rows`` takes (its row tile)
FEW_TILE = (32, 256)  # ``few_rows``' BLOCK_N x BLOCK_K: the H200 sweep's fastest at 16 rows on each 8B matrix
SCALE_ROWS_PAD = 4  # cuBLASLt's block-scaled GEMM wants the token count, and the weight's column blocks, in fours


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` of an e4m3 ``weight`` takes this module: Triton imported, a
    2-D half-precision CUDA input, the weight's rows contiguous."""
    return (
        triton is not None
        and x.is_cuda
        and x.dim() == 2
        and x.dtype in HALF_DTYPES
        and weight.dtype == FP8
        and weight.stride(1) == 1
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    kind: str | None = None,
) -> torch.Tensor:
    """``x [M, K] @ (weight * scale)[N, K].T (+ bias)`` in ``x``'s dtype, by ``product``'s choice
    unless ``kind`` names one (the benchmark's)."""
    kind = kind or product(x, weight, scale, block)
    if kind == "one_row":
        return one_row(x, weight, scale, block, bias)
    if kind == "few_rows":
        return few_rows(x, weight, scale, block, bias)
    if kind == "rows":
        q, q_scale = quantize(x, x.shape[1])
        out = torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    elif kind == "blocks":
        q, q_scale = quantize(x, block[1], pad_rows=SCALE_ROWS_PAD)
        recipe = F.ScalingType
        out = F.scaled_mm(
            q,
            weight.t(),
            q_scale,
            recipe.BlockWise1x128,
            scale.t(),
            recipe.BlockWise128x128,
            output_dtype=x.dtype,
        )[: x.shape[0]]
    else:
        out = F.linear(x, dequantize(weight, scale, block, x.dtype))
    return out if bias is None else out.add_(bias)


def product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> str:
    """Which product ``linear`` runs: ``one_row``; cuBLASLt's FP8 GEMM with per-token scales
    (``rows``, the row-scale layouts) or 1 x 128 ones (``blocks``); ``few_rows`` where it measured
    faster than ``rows`` (up to ``FEW_ROWS``) or where neither GEMM takes the product (up to
    ``FEW_ROWS_MAX``); else ``dequantize``."""
    rows = x.shape[0]
    if rows == 1:
        return "one_row"
    n, k = weight.shape
    gemm = None
    if n % 16 == 0 and k % 16 == 0 and x.dtype == torch.bfloat16:  # what cuBLASLt's FP8 GEMM takes (bf16 out)
        if block is None:
            gemm = "rows"
        elif block == (128, 128) and scale.shape[1] % SCALE_ROWS_PAD == 0 and blockwise_supported(x.device):
            gemm = "blocks"
    few = rows <= FEW_ROWS_MAX and (block is None or (block[0] % 16 == 0 and block[1] % 16 == 0))
    if few and (gemm is None or (gemm == "rows" and rows <= FEW_ROWS)):
        return "few_rows"
    return gemm or "dequantize"


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype):
    """``weight`` times its scales, in ``dtype`` (float32 first)."""
    if block is not None:
        rows, columns = weight.shape
        scale = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return (weight.float() * scale).to(dtype)


def blockwise_supported(device: torch.device) -> bool:
    """Whether torch's ``scaled_mm`` takes 1x128 activation and 128x128 weight scales here
    (torch 2.9 and CUDA 12.9 or later, on Hopper): one tiny product, tried once per device
    outside a CUDA graph's capture (the load's compile-ahead and profiling's prefill come first;
    a capture that asks first gets the dequantizing path)."""
    if device not in _BLOCKWISE:
        if torch.cuda.is_current_stream_capturing():
            return False
        _BLOCKWISE[device] = _try_blockwise(device)
    return _BLOCKWISE[device]


def _try_blockwise(device: torch.device) -> bool:
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    try:
        k = 128 * SCALE_ROWS_PAD  # whole fours of column blocks
        a, b = torch.zeros(SCALE_ROWS_PAD, k, device=device).to(FP8), torch.zeros(128, k, device=device).to(FP8)
        a_scale = torch.ones(SCALE_ROWS_PAD, SCALE_ROWS_PAD, device=device).t()  # column-major
        b_scale = torch.ones(1, SCALE_ROWS_PAD, device=device)  # the weight's [row blocks, column blocks]
        recipe = F.ScalingType
        F.scaled_mm(
            a, b.t(), a_scale, recipe.BlockWise1x128, b_scale.t(), recipe.BlockWise128x128, output_dtype=torch.bfloat16
        )
        torch.cuda.synchronize(device)
        return True
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return False


def tile(n: int, k: int) -> tuple[int, int]:
    """The one-row kernel's ``(BLOCK_N, BLOCK_K)`` for an ``[n, k]`` weight: the fastest of the
    H200 sweep for the 8B's matrices (benchmarks/README.md, "FP8 projections"), by their shape."""
    if n >= 16384 and k < 8192:  # wide and short (fused gate/up): more rows a program, shorter strides
        return 16, 256
    if n > 4096 and k <= 4096:  # fused q/k/v
        return 4, 1024
    return 8, 1024  # square (o) and long (down)


def quantize(x: torch.Tensor, group: int, pad_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` in e4m3 and its float32 scales, one per row and ``group`` columns (``group``
    ``K``: per token, scales ``[M, 1]``; else ``[M', K / group]`` stored column-major as cuBLASLt
    takes them, ``M'`` the rows rounded up to ``pad_rows``, the added rows zero)."""
    rows, k = x.shape
    padded = -(-rows // pad_rows) * pad_rows
    groups = -(-k // group)
    q = torch.empty(padded, k, dtype=FP8, device=x.device)
    scale = torch.empty(groups, padded, dtype=torch.float32, device=x.device).t()  # column-major [padded, groups]
    x = x if x.stride(1) == 1 else x.contiguous()
    _quantize_kernel[(padded, groups)](
        x,
        q,
        scale,
        rows,
        k,
        x.stride(0),
        scale.stride(0),
        scale.stride(1),
        GROUP=group,
        BLOCK=triton.next_power_of_2(group),
        num_warps=8 if group >= 4096 else 4,
    )
    return q, scale


def one_row(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """``x [1, K] @ (weight * scale).T (+ bias)`` as ``[1, N]`` in ``x``'s dtype (``block_n``
    and ``block_k``: the tile, ``tile``'s unless the benchmark's sweep names one)."""
    n, k = weight.shape
    chosen = tile(n, k)
    block_n, block_k = block_n or chosen[0], block_k or chosen[1]
    if block is not None:  # a program's rows share one row block of scales
        block_n = math.gcd(block_n, block[0])
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _one_row_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        scale,
        bias if bias is not None else out,
        out,
        n,
        k,
        weight.stride(0),
        scale.stride(0),
        SCALE_ROWS=block[0] if block else 1,
        SCALE_COLS=block[1] if block else 0,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


def few_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """``x [M, K] @ (weight * scale).T (+ bias)`` for a few rows (``M`` up to ``FEW_ROWS_MAX``), weight-only:
    ``tl.dot`` of the 16-bit rows and the e4m3 weight widened in registers, a block's scale
    applied to its partial sums (a tile within one scale block: ``block``'s sides multiples of
    16), a row's after the sum. ``block_n`` and ``block_k``: the tile, ``FEW_TILE`` by default."""
    rows, k = x.shape
    n = weight.shape[0]
    block_n, block_k = block_n or FEW_TILE[0], block_k or FEW_TILE[1]
    if block is not None:
        block_n, block_k = math.gcd(block_n, block[0]), math.gcd(block_k, block[1])
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _few_rows_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        scale,
        bias if bias is not None else out,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        SCALE_ROWS=block[0] if block else 1,
        SCALE_COLS=block[1] if block else 0,
        HAS_BIAS=bias is not None,
        BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _MIN_AMAX = tl.constexpr(MIN_AMAX)

    @triton.jit
    def _one_row_kernel(
        X,
        W,
        S,
        Bias,
        Out,
        N,
        K,
        stride_wn,
        stride_sn,
        SCALE_ROWS: tl.constexpr,
        SCALE_COLS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        first = tl.program_id(0) * BLOCK_N
        n = first + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        wide = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # each thread's products, summed across threads once
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
            x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)
            if SCALE_COLS > 0:  # block scales: the row's columns by their block's, the program's rows in one row block
                x *= tl.load(S + (first // SCALE_ROWS) * stride_sn + k // SCALE_COLS, mask=k < K, other=0.0)
            wide += x[None, :] * w.to(tl.float32)
        acc = tl.sum(wide, axis=1)
        if SCALE_COLS == 0:  # one scale per row
            acc *= tl.load(S + n * stride_sn, mask=n < N, other=0.0)
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(Out + n, acc.to(Out.dtype.element_ty), mask=n < N)

    @triton.jit(do_not_specialize=["M"])
    def _few_rows_kernel(
        X,
        W,
        S,
        Bias,
        Out,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_sn,
        SCALE_ROWS: tl.constexpr,
        SCALE_COLS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        first = tl.program_id(0) * BLOCK_N
        n = first + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
            if SCALE_COLS > 0:  # the tile lies in one scale block
                part *= tl.load(S + (first // SCALE_ROWS) * stride_sn + k0 // SCALE_COLS)
            acc += part
        if SCALE_COLS == 0:
            acc *= tl.load(S + n * stride_sn, mask=n < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        out = Out + m[:, None] * N + n[None, :]
        tl.store(out, acc.to(Out.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])

    @triton.jit(do_not_specialize=["M", "stride_sg"])  # a step's token count (and its padded rows) vary
    def _quantize_kernel(X, Q, S, M, K, stride_xm, stride_sm, stride_sg, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0)
        g = tl.program_id(1)
        offsets = tl.arange(0, BLOCK)
        k = g * GROUP + offsets
        inside = (offsets < GROUP) & (k < K)
        x = tl.load(X + m * stride_xm + k, mask=inside & (k < K * (m < M)), other=0.0).to(tl.float32)  # padding rows: 0
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), _MIN_AMAX) / _FP8_MAX
        q = tl.clamp(x / scale, -_FP8_MAX, _FP8_MAX)
        tl.store(Q + m * K + k, q.to(Q.dtype.element_ty), mask=inside)
        tl.store(S + m * stride_sm + g * stride_sg, scale)
