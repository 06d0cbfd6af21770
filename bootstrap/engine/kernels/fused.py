"""Triton kernels for the small steps between the GEMMs: RMSNorm with the residual add folded in,
rotary embeddings of q and k in place, and the MLP's activation times ``up``. In eager PyTorch
each is a chain of small kernels (an RMSNorm alone is eight), which at decode batch sizes cost
as much GPU time as the weights' reads; here each is one kernel.

Each kernel rounds to the tensor's dtype where the eager code rounds (the residual sum, the
normalised value, each product of the rotation, the activation), so it gives the eager results
to a unit or two in the last place (its float32 math contracted into FMAs, one reciprocal square
root, its own reduction order; tests/gpu/test_fused_kernels.py measures it). Triton compiles a
kernel once per shape class and keeps it in its on-disk cache (``~/.triton/cache``), so a later
start loads it instead of compiling. ``usable(x)``: Triton imported and ``x`` on a CUDA device;
elsewhere the layers run their eager code.
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

ACTIVATION_IDS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


def usable(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``norm(x)``, or with ``residual``: ``s = x + residual`` (rounded to the dtype) and
    ``(norm(s), s)``. Rows are the last dimension of ``x``; any leading shape."""
    shape, n = x.shape, x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # contiguous: the kernel writes rows of n
    summed = torch.empty_like(out) if residual is not None else out
    res = residual.reshape(-1, n) if residual is not None else rows
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        res,
        weight,
        out,
        summed,
        rows.stride(0),
        res.stride(0),
        n,
        eps,
        offset,
        HAS_RESIDUAL=residual is not None,
        OFFSET_FORM=offset != 0.0,
        BLOCK=triton.next_power_of_2(n),
        num_warps=_warps(n),
    )
    return out.view(shape), (summed.view(shape) if residual is not None else None)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` in place by ``cos, sin [T, D]`` (last
    dimension contiguous; ``q`` and ``k`` may be views of one fused projection)."""
    tokens, heads, dim = q.shape
    half = dim // 2
    _rotary_kernel[(tokens,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        HQ=heads,
        HK=k.shape[1],
        HALF=half,
        HQ_PAD=triton.next_power_of_2(heads),
        HK_PAD=triton.next_power_of_2(k.shape[1]),
        HALF_PAD=triton.next_power_of_2(half),
    )


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up [T, 2I]`` (gate then up), ``[T, I]``."""
    tokens, width = gate_up.shape
    n = width // 2
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _act_mul_kernel[(tokens, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, ACT=ACTIVATION_IDS[activation], BLOCK=block
    )
    return out


def _warps(n: int) -> int:
    return 8 if n >= 4096 else 4 if n >= 1024 else 1


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        X,
        R,
        W,
        Out,
        Summed,
        stride_x,
        stride_r,
        n,
        eps,
        offset,
        HAS_RESIDUAL: tl.constexpr,
        OFFSET_FORM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(Summed + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        normed = xf * (1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps))
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        # SIM108: a constexpr branch, resolved when the kernel compiles; kept a statement with its comments
        if OFFSET_FORM:  # noqa: SIM108 -- Gemma: (x * (offset + w)) in float32, rounded once
            y = normed * (offset + w)
        else:  # Llama: the normalised value rounded to the dtype, then times the weight
            y = normed.to(X.dtype.element_ty).to(tl.float32) * w
        tl.store(Out + row * n + cols, y.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate(
        base,
        stride_h,
        cos1,
        cos2,
        sin1,
        sin2,
        H: tl.constexpr,
        H_PAD: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
    ):
        """``x * cos + rotate_half(x) * sin`` with each product and the sum rounded, as eager."""
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, HALF_PAD)
        mask = (h < H)[:, None] & (d < HALF)[None, :]
        first = base + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + HALF, mask=mask, other=0.0)
        dtype = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        out1 = (f1 * cos1).to(dtype).to(tl.float32) + (-f2 * sin1).to(dtype).to(tl.float32)
        out2 = (f2 * cos2).to(dtype).to(tl.float32) + (f1 * sin2).to(dtype).to(tl.float32)
        tl.store(first, out1.to(dtype), mask=mask)
        tl.store(first + HALF, out2.to(dtype), mask=mask)

    @triton.jit
    def _rotary_kernel(
        Q,
        K,
        Cos,
        Sin,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_ct,
        stride_st,
        HQ: tl.constexpr,
        HK: tl.constexpr,
        HALF: tl.constexpr,
        HQ_PAD: tl.constexpr,
        HK_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
    ):
        t = tl.program_id(0)
        d = tl.arange(0, HALF_PAD)
        m = d < HALF
        cos1 = tl.load(Cos + t * stride_ct + d, mask=m, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(Cos + t * stride_ct + HALF + d, mask=m, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(Sin + t * stride_st + d, mask=m, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(Sin + t * stride_st + HALF + d, mask=m, other=0.0).to(tl.float32)[None, :]
        _rotate(Q + t * stride_qt, stride_qh, cos1, cos2, sin1, sin2, HQ, HQ_PAD, HALF, HALF_PAD)
        _rotate(K + t * stride_kt, stride_kh, cos1, cos2, sin1, sin2, HK, HK_PAD, HALF, HALF_PAD)

    @triton.jit
    def _act_mul_kernel(X, Out, stride_x, stride_o, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        if ACT == 0:
            a = g / (1.0 + tl.exp(-g))
        elif ACT == 1:
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
        else:
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        a = a.to(gate.dtype).to(tl.float32)
        tl.store(Out + row * stride_o + cols, (a * up).to(Out.dtype.element_ty), mask=mask)
