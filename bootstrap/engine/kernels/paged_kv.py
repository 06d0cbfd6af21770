"""Paged decode attention as one Triton kernel: each row's query heads against only the blocks
its context fills, read once through its block table (no gathered copy of the context, no mask).

One program per (row, KV head, split): the row's ``G`` query heads of that KV head (padded to 16
rows for ``tl.dot``) attend over the row's blocks up to its context length (from its window start
with a sliding window), with an online softmax in float32. The loop bound is read on the device,
so a CUDA graph captured over a static-width block table replays any context length. Float32
inputs use IEEE products (no TF32). Needs Triton and 16 tokens a block or more (``available()``).
A few rows leave the device idle at one program per ``rows x KV heads``, so each row's blocks
split in up to ``splits`` runs (flash-decoding) that a second kernel merges; ``num_splits`` picks
the count, fixed at a graph's capture. An e4m3 pool (``kv_cache_dtype fp8``) is written divided
by its layer's scales, saturated, and read back scaled: the key scale joins the softmax scale,
the value scale the output.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

from bootstrap.engine.kernels import triton_start

triton_start.wait()  # a thread may be importing Triton (``triton_start``): never two threads at once
try:  # an optional dependency: CPU builds of torch come without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available(device: torch.device, tokens_per_block: int) -> bool:
    """True when the kernel can run here: Triton importable, a CUDA device (or Triton's
    interpreter), and blocks of at least 16 tokens (``tl.dot``'s smallest dimension)."""
    if triton is None or tokens_per_block < 16 or tokens_per_block & (tokens_per_block - 1):
        return False
    return device.type == "cuda" or _interpreting()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _unspecialized(*names: str) -> dict[str, list[str]]:
    """``triton.jit`` options that keep Triton from compiling the kernel again for each alignment
    or divisibility by 16 of these arguments: views into one split tensor (a step's context
    lengths, its rows and slots) and the block table's width vary between steps and between the
    probe and the final executor, so a specialized kernel compiled during a request instead of
    ahead. Triton before 3.2 has only ``do_not_specialize``, which covers both."""
    options = {"do_not_specialize": list(names)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = list(names)
    return options


if triton is not None:

    @triton.jit(**_unspecialized("Tables", "Lens", "window", "stride_tb", "splits"))
    def _paged_decode_kernel(
        Q,
        K,
        V,
        KScale,
        VScale,
        Tables,
        Lens,
        Out,
        Partial,
        Stats,
        scale,
        softcap,
        window,
        splits,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_tb,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        TPB: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        IEEE: tl.constexpr,
        STATIC_BLOCKS: tl.constexpr,
        HEADS: tl.constexpr,
        SPLIT: tl.constexpr,
        SCALED: tl.constexpr,
        STEP: tl.constexpr,
        F16: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if SCALED:  # e4m3 keys: their scale joins the softmax's
            scale = scale * tl.load(KScale)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        t = tl.arange(0, TPB * STEP)  # an iteration's tokens: STEP blocks
        heads = kv_head * GROUP + g
        q_mask = (g < GROUP)[:, None] & (d < D)[None, :]
        q = tl.load(Q + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        if F16:  # float16 dots: the scale applied to the query first keeps it in float16's range
            q = (q.to(tl.float32) * scale).to(tl.float16)
            scale = 1.0
        length = tl.load(Lens + row).to(tl.int32)
        start = 0
        if HAS_WINDOW:
            start = tl.maximum(length - window, 0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        first, last = start // TPB, tl.cdiv(length, TPB)
        if SPLIT:  # this program's run of the row's blocks: the split-th of ``splits`` equal runs
            per = tl.cdiv(last - first, splits)
            first = first + split * per
            last = tl.minimum(first + per, last)
        lo, hi = first, last
        if STATIC_BLOCKS > 0:  # Triton's CPU interpreter: every column, the masks do the rest
            first, last = 0, STATIC_BLOCKS
        for i in range(first, last, STEP):
            pos = i * TPB + t
            valid = (pos < length) & (pos >= start) & (pos >= lo * TPB) & (pos < hi * TPB)
            kv_mask = valid[:, None] & (d < D)[None, :]
            if STEP == 1:  # one block id for the iteration
                block = tl.load(Tables + row * stride_tb + i).to(tl.int64)
                offsets = block * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
            else:  # each token's block id, columns past the run masked
                col = i + t // TPB
                block = tl.load(Tables + row * stride_tb + col, mask=col < last, other=0).to(tl.int64)
                rows_at = block[:, None] * stride_kb + (t % TPB)[:, None] * stride_kt
                offsets = rows_at + kv_head * stride_kh + d[None, :]
            k = tl.load(K + offsets, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(V + offsets, mask=kv_mask, other=0.0).to(q.dtype)
            if IEEE:  # noqa: SIM108 -- a constexpr branch, resolved when the kernel compiles
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            if HAS_SOFTCAP:
                s = (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * softcap  # tanh(s / cap) * cap
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing valid yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if SCALED:  # e4m3 values: their scale, once
            acc = acc * tl.load(VScale)
        if SPLIT:  # the run's unnormalized output, maximum and sum, for _merge_splits_kernel
            at = (row * splits + split) * HEADS + heads  # rows of [rows, splits, HEADS]
            tl.store(Partial + at[:, None] * D + d[None, :], acc, mask=q_mask)
            tl.store(Stats + at * 2, m, mask=g < GROUP)
            tl.store(Stats + at * 2 + 1, denom, mask=g < GROUP)
        else:
            out = acc / denom[:, None]
            tl.store(
                Out + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                out.to(Out.dtype.element_ty),
                mask=q_mask,
            )

    @triton.jit(**_unspecialized("splits"))
    def _merge_splits_kernel(
        Partial,
        Stats,
        Out,
        splits,
        stride_ob,
        stride_oh,
        HEADS: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, D_PAD)
        m = tl.full([1], float("-inf"), tl.float32)
        denom = tl.zeros([1], tl.float32)
        acc = tl.zeros([D_PAD], tl.float32)
        for split in range(splits):
            at = (row * splits + split) * HEADS + head
            m_run = tl.load(Stats + at * 2 + tl.arange(0, 1))
            m_new = tl.maximum(m, m_run)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # runs with nothing valid so far
            alpha, beta = tl.exp(m - m_safe), tl.exp(m_run - m_safe)
            denom = denom * alpha + tl.load(Stats + at * 2 + 1 + tl.arange(0, 1)) * beta
            acc = acc * alpha + tl.load(Partial + at * D + d, mask=d < D, other=0.0) * beta
            m = m_new
        out = acc / denom
        tl.store(Out + row * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < D)


if triton is not None:

    @triton.jit(**_unspecialized("Key", "Value", "Rows", "Slots"))
    def _write_kv_kernel(
        Key,
        Value,
        Rows,
        Slots,
        KC,
        VC,
        KScale,
        VScale,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cs,
        stride_ch,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        src = tl.load(Rows + row).to(tl.int64)
        slot = tl.load(Slots + row).to(tl.int64)
        d = tl.arange(0, D_PAD)
        mask = d < D
        k = tl.load(Key + src * stride_kt + head * stride_kh + d, mask=mask)
        v = tl.load(Value + src * stride_vt + head * stride_vh + d, mask=mask)
        if SCALED:  # e4m3: divided by the layer's scales, saturated at 448
            k = tl.clamp(k.to(tl.float32) / tl.load(KScale), -448.0, 448.0)
            v = tl.clamp(v.to(tl.float32) / tl.load(VScale), -448.0, 448.0)
        tl.store(KC + slot * stride_cs + head * stride_ch + d, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + slot * stride_cs + head * stride_ch + d, v.to(VC.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store ``key[rows[i]]`` and ``value[rows[i]]`` (``[T, KVH, D]``, any strides) at flat slot
    ``slots[i]`` of the caches ``[blocks, tpb, KVH, D]``: one kernel for what would be two
    gathers and two scatters. Padding rows repeat a real row, so a repeated slot gets equal bits.
    ``scales``: an e4m3 pool's key and value scales (0-dim float32 tensors)."""
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    kv_heads, head_dim = k_flat.shape[1], k_flat.shape[2]
    _write_kv_kernel[(slots.shape[0], kv_heads)](
        key,
        value,
        rows,
        slots,
        k_flat,
        v_flat,
        *(scales or (k_flat, v_flat)),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        SCALED=scales is not None,
        num_warps=1,
    )


# The kernel's defaults, from benchmarks/decode_attention_splits.py (benchmarks/README.md, "An FP8 KV cache")
BLOCKS_PER_STEP = 1  # either pool: 2 and 4 were faster only for one split row
E4M3_FLOAT16_DOTS = True  # an e4m3 pool's dots in float16 under a bfloat16 query (measured faster)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    splits: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    blocks_per_step: int | None = None,
    dot_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``q [B, H, D]`` (one token per row) against caches ``[blocks, tpb, KVH, D]``; ``[B, H, D]``.
    ``scale`` None: ``head_dim ** -0.5``, as SDPA's default. ``splits``: runs per row (None:
    ``num_splits`` for this grid and table width). ``scales``: an e4m3 pool's key and value scales.
    ``blocks_per_step``: blocks each loop iteration reads, a power of two; ``dot_dtype``: the dots'
    operand dtype, the query's or float16 (None: the measured defaults above)."""
    if blocks_per_step is None:
        blocks_per_step = BLOCKS_PER_STEP
    if dot_dtype is None:
        bfloat16_over_e4m3 = scales is not None and q.dtype == torch.bfloat16
        dot_dtype = torch.float16 if bfloat16_over_e4m3 and E4M3_FLOAT16_DOTS else q.dtype
    if blocks_per_step < 1 or blocks_per_step & (blocks_per_step - 1):
        raise ValueError(f"blocks_per_step must be a power of two >= 1, got {blocks_per_step}")
    if dot_dtype not in (None, q.dtype, torch.float16):
        raise ValueError(f"dot_dtype must be the query's dtype or torch.float16, got {dot_dtype}")
    rows, heads, head_dim = q.shape
    scale = scale if scale is not None else head_dim**-0.5
    _, tpb, kv_heads, _ = k_cache.shape
    if splits is None:
        splits = num_splits(rows * kv_heads, block_tables.shape[1], programs_wanted(q.device))
    q = q if q.stride(-1) == 1 else q.contiguous()  # rows and heads go by their strides: a q/k/v view needs no copy
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    partial = stats = out  # unread without a split
    if splits > 1:
        partial = torch.empty(rows, splits, heads, head_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(rows, splits, heads, 2, dtype=torch.float32, device=q.device)
    group, d_pad = heads // kv_heads, max(16, triton.next_power_of_2(head_dim))
    _paged_decode_kernel[(rows, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        *(scales or (k_cache, v_cache)),
        block_tables,
        context_lens,
        out,
        partial,
        stats,
        float(scale),
        float(softcap or 1.0),
        int(sliding_window or 0),
        splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=head_dim,
        D_PAD=d_pad,
        TPB=tpb,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        IEEE=q.dtype == torch.float32,
        STATIC_BLOCKS=block_tables.shape[1] if _interpreting() else 0,
        HEADS=heads,
        SPLIT=splits > 1,
        SCALED=scales is not None,
        STEP=blocks_per_step,
        F16=dot_dtype == torch.float16 and q.dtype != torch.float16,
        num_warps=4,
    )
    if splits > 1:
        _merge_splits_kernel[(rows, heads)](
            partial,
            stats,
            out,
            splits,
            out.stride(0),
            out.stride(1),
            HEADS=heads,
            D=head_dim,
            D_PAD=d_pad,
            num_warps=1,
        )
    return out


MIN_SPLIT_BLOCKS = 4  # the fewest table columns a run may cover (the runs' real lengths follow the context)
MAX_SPLITS = 16


def num_splits(programs: int, width: int, wanted: int) -> int:
    """Runs per row for a grid of ``programs`` (rows × KV heads) over a table ``width`` columns
    wide: enough for about ``wanted`` programs in all, none under ``MIN_SPLIT_BLOCKS`` columns,
    at most ``MAX_SPLITS``; 1 (no merge) once the grid fills the device by itself."""
    return max(1, min(wanted // max(programs, 1), width // MIN_SPLIT_BLOCKS, MAX_SPLITS))


@functools.cache
def programs_wanted(device: torch.device) -> int:
    """Four programs per streaming multiprocessor (Triton's interpreter: a fixed 16): on a
    132-multiprocessor device that splits rows in two at batch 32 of an 8-KV-head model and in
    none at 64, where splitting measured slower (benchmarks/README.md, "The paged decode kernel
    split in runs")."""
    if device.type != "cuda":
        return 16
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count
