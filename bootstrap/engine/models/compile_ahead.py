"""Triton's first compile of the own code's kernels, overlapped with the load.

Where Triton's cache does not hold them yet, compiling a model's kernels takes seconds, paid by
its first forward. ``compiling_ahead(model)`` launches each kernel once on zero tensors of the
model's own widths and dtype (so Triton specializes it as the real calls will) while the block
runs (the weights being read): the norm, rotary and activation kernels (``kernels.fused``), the
one-row linear kernel (``kernels.gemv``; for FP8 weights ``kernels.fp8_gemm``'s one-row and
few-rows kernels and its activation quantizer), the paged decode kernel whole and split (with
the merge) and the KV-write kernel (``kernels.paged_kv``, at the default block size). Each
kernel, split count and FP8 row tile gets a thread, so compiles run side by side and none twice;
Triton's own start (``triton_start``) comes first. The threads are joined when the block ends; an
error there only means the real call compiles the kernel. ``begin_early`` starts the same sooner,
on a model built on the meta device (shapes only); the block's threads wait for those first.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from bootstrap.config import BootstrapConfig
from bootstrap.engine.kernels import fp8_gemm, fused, gemv, paged_kv, triton_start
from bootstrap.engine.layers.norm import RMSNorm

TOKENS_PER_BLOCK = BootstrapConfig.model_fields["tokens_per_block"].default
FEW_ROWS_TILES = (2, 32, 64)  # a row count for each of ``fp8_gemm.few_rows``' row tiles (16, 32, 64)
log = logging.getLogger(__name__)


_early_lock = threading.Lock()
_early: threading.Thread | None = None  # begin_early's, once per process


@contextlib.contextmanager
def compiling_ahead(model: torch.nn.Module) -> Iterator[None]:
    """Compile ``model``'s kernels in threads while the block runs (nothing off CUDA)."""
    param = next(model.parameters())
    if not fused.usable(param):
        yield
        return
    with _early_lock:
        early = _early
    launched = _launched(model, param.dtype, param.device, after=early)
    try:
        yield
    finally:
        launched()


def begin_early(build: Callable[[], torch.nn.Module], device: torch.device, dtype: torch.dtype) -> bool:
    """Compile, in a thread started now, the kernels of the model ``build`` makes (on the meta
    device: shapes only) in ``dtype`` on ``device``, once per process; True when begun. A model of
    other shapes only compiles its own later (``compiling_ahead``)."""
    global _early
    if device.type != "cuda" or fused.triton is None:
        return False
    with _early_lock:
        if _early is None:
            _early = threading.Thread(
                target=_compile_early, args=(build, device, dtype), name="bootstrap-kernel-compile-early"
            )
            _early.start()
    return True


def _compile_early(build: Callable[[], torch.nn.Module], device: torch.device, dtype: torch.dtype) -> None:
    try:
        _launched(build(), dtype, device, after=None)()
    except Exception as exc:  # a model the load refuses (naming the cause): the load compiles what it runs
        log.info("no kernels compiled early: %s", exc)


def _launched(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device, after: threading.Thread | None
) -> Callable[[], None]:
    """Each group of ``model``'s launches started in a thread of its own (after ``after``, joined
    first); the function that joins them."""
    triton_start.begin()  # once per process, before any compile
    calls = sorted(set(_calls(model)), key=lambda call: (str(_specialization(call)), str(call)))
    by_kernel = itertools.groupby(calls, key=_specialization)
    groups = [list(group) for _, group in by_kernel]
    pool = ThreadPoolExecutor(len(groups), thread_name_prefix="bootstrap-kernel-compile")
    futures = [pool.submit(_launch_each, group, dtype, device, after) for group in groups]

    def joined() -> None:
        pool.shutdown(wait=True)
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            log.info("compiling the kernels ahead failed (%s); the first forward compiles them", failed[0])

    return joined


def _specialization(call: tuple) -> tuple:
    """What Triton compiles once: a kernel, and for the paged kernel its split count, for the FP8
    few-rows kernel its row tile (a shape of ``gemv`` or a norm's width reuses one compile)."""
    return (call[0], call[-1]) if call[0] in ("decode", "fp8_few") else (call[0],)


def _launch_each(calls: list[tuple], dtype: torch.dtype, device: torch.device, after: threading.Thread | None) -> None:
    triton_start.wait()
    if after is not None:
        after.join()  # the early compile's kernels: found compiled, not compiled twice
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        for call in calls:
            _launch(call, dtype, device)
        torch.cuda.current_stream().synchronize()


def _calls(model: torch.nn.Module) -> Iterator[tuple]:
    """One tuple per distinct kernel specialization the forward launches, the kernel's name first."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype in gemv.HALF_DTYPES:
            yield ("gemv", *module.weight.shape, module.bias is not None)
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == fp8_gemm.FP8:
            block = module.fp8_block
            yield ("fp8_row", *module.weight.shape, block, module.bias is not None)
            for rows in FEW_ROWS_TILES:  # one compile per row tile (``few_rows``' BLOCK_M)
                yield ("fp8_few", *module.weight.shape, block, module.bias is not None, rows)
            yield ("fp8_quantize", module.weight.shape[1], block[1] if block else module.weight.shape[1])
        if isinstance(module, RMSNorm):
            yield ("norm", module.weight.shape[0], module.offset)
        attention = getattr(module, "self_attn", None)
        if attention is not None:
            width = attention.qkv_proj.weight.shape[0]
            yield (
                "rotary",
                width,
                attention.heads,
                attention.kv_heads,
                attention.head_dim,
                attention.q_norm is not None,
            )
            yield ("act", module.mlp.gate_up_proj.weight.shape[0], module.mlp.activation)
            yield ("write_kv", attention.kv_heads, attention.head_dim)
            for splits in (1, 2):  # whole rows, and rows split in runs with the merge kernel after them
                yield (
                    "decode",
                    attention.heads,
                    attention.kv_heads,
                    attention.head_dim,
                    attention.sliding_window is not None,
                    attention.softcap is not None,
                    splits,
                )


def _launch(call: tuple, dtype: torch.dtype, device: torch.device) -> None:
    kind, *shape = call
    zeros = lambda *size: torch.zeros(*size, dtype=dtype, device=device)  # noqa: E731
    indices = lambda: torch.zeros(1, dtype=torch.long, device=device)  # noqa: E731
    if kind == "norm":
        dim, offset = shape
        x, weight = zeros(1, dim), zeros(dim)
        fused.rms_norm(x, weight, 1e-6, offset)
        fused.rms_norm(x, weight, 1e-6, offset, residual=zeros(1, dim))
    elif kind == "rotary":
        width, heads, kv_heads, head_dim, normed = shape
        qkv = zeros(1, width)
        q = qkv[:, : heads * head_dim].view(1, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, kv_heads, head_dim)
        if normed:  # q/k norm (qwen3) hands the rotary contiguous copies
            q, k = q.contiguous(), k.contiguous()
        fused.rotary_(q, k, zeros(1, head_dim), zeros(1, head_dim))
    elif kind == "act":
        width, activation = shape
        fused.act_mul(zeros(1, width), activation)
    elif kind == "gemv":
        n, k, has_bias = shape
        weight = zeros(1, k).expand(n, k)  # the same specialization as the layer's [n, k] weight, for k elements
        gemv.linear(zeros(1, k), weight, zeros(n) if has_bias else None)
    elif kind in ("fp8_row", "fp8_few"):
        n, k, block, has_bias, *rows = shape
        weight = torch.empty(1, k, dtype=fp8_gemm.FP8, device=device).expand(n, k)
        scales = (-(-n // block[0]), -(-k // block[1])) if block else (n, 1)
        scale, bias = torch.ones(scales, device=device), zeros(n) if has_bias else None
        if not rows:
            fp8_gemm.one_row(zeros(1, k), weight, scale, block, bias)
        elif fp8_gemm.product(zeros(rows[0], k), weight, scale, block) == "few_rows":
            fp8_gemm.few_rows(zeros(rows[0], k), weight, scale, block, bias)
    elif kind == "fp8_quantize":
        k, group = shape
        fp8_gemm.quantize(zeros(2, k), group, pad_rows=fp8_gemm.SCALE_ROWS_PAD if group < k else 1)
        if group < k:
            fp8_gemm.blockwise_supported(device)  # probed now, never first inside a capture
    elif kind == "write_kv":
        kv_heads, head_dim = shape
        cache, key = zeros(1, TOKENS_PER_BLOCK, kv_heads, head_dim), zeros(1, kv_heads, head_dim)
        paged_kv.write_kv(key, key, indices(), indices(), cache, cache)
    else:
        heads, kv_heads, head_dim, windowed, capped, splits = shape
        cache, lengths = zeros(1, TOKENS_PER_BLOCK, kv_heads, head_dim), torch.ones(1, dtype=torch.long, device=device)
        paged_kv.paged_decode(
            zeros(1, heads, head_dim),
            cache,
            cache,
            indices().view(1, 1),
            lengths,
            None,
            8 if windowed else None,
            30.0 if capped else None,
            splits,
        )
