"""Triton's first compile of the own code's kernels (``layers.fused``), overlapped with the load.

On a machine whose Triton cache does not hold them yet, compiling the kernels a model launches
takes seconds, paid by its first forward (the profiling stage's). ``compiling_ahead(model)``
launches each kernel once, in a thread, on zero tensors of the model's own widths and dtype (so
Triton specializes it exactly as the real calls will), while the block runs (the weights being
read); the thread is joined when the block ends, so none outlives the load, and an error there
only means the real call compiles the kernel itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

from bootstrap.engine.layers import fused
from bootstrap.engine.layers.norm import RMSNorm

log = logging.getLogger(__name__)


@contextlib.contextmanager
def compiling_ahead(model: torch.nn.Module) -> Iterator[None]:
    """Compile ``model``'s kernels in a thread while the block runs (nothing off CUDA)."""
    param = next(model.parameters())
    if not fused.usable(param):
        yield
        return
    failed: list[BaseException] = []
    worker = threading.Thread(target=_launch_each, args=(model, param.dtype, param.device, failed),
                              name="bootstrap-kernel-compile", daemon=True)  # fmt: skip
    worker.start()
    try:
        yield
    finally:
        worker.join()
        if failed:
            log.info("compiling the kernels ahead failed (%s); the first forward compiles them", failed[0])


def _launch_each(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, failed: list) -> None:
    try:
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            for call in sorted(set(_calls(model)), key=str):
                _launch(call, dtype, device)
            torch.cuda.current_stream().synchronize()
    except Exception as exc:  # the real call compiles it then
        failed.append(exc)


def _calls(model: torch.nn.Module) -> Iterator[tuple]:
    """One tuple per distinct kernel specialization the forward launches."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            yield ("norm", module.weight.shape[0], module.offset)
        attention = getattr(module, "self_attn", None)
        if attention is not None:
            width = attention.qkv_proj.weight.shape[0]
            yield ("rotary", width, attention.heads, attention.kv_heads, attention.head_dim, attention.q_norm is not None)
            yield ("act", module.mlp.gate_up_proj.weight.shape[0], module.mlp.activation)


def _launch(call: tuple, dtype: torch.dtype, device: torch.device) -> None:
    kind, *shape = call
    zeros = lambda *size: torch.zeros(*size, dtype=dtype, device=device)  # noqa: E731
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
    else:
        width, activation = shape
        fused.act_mul(zeros(1, width), activation)
