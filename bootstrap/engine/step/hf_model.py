"""A transformers model in the engine: its attention switched to ``paged_attention``
(``attn_implementation="bootstrap_paged"``, which reads the step's metadata from a thread-local),
its forward, and the ``torch.compile`` of its norms or layers before graph capture. The engine's
own model code (``bootstrap.engine.models``) needs none of this."""

from __future__ import annotations

import functools

import torch

from bootstrap.engine.layers.attention import (
    ATTN_IMPLEMENTATION,
    AttentionMetadata,
    DecodeMetadata,
    paged_attention,
    register,
    use_metadata,
)


def use_paged_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (in place) to the paged attention function, or say why it cannot be."""
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        register()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            f"so '{ATTN_IMPLEMENTATION}' cannot be set on it; the native engine cannot run this model"
        )


def forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_to_keep: torch.Tensor | int,
    metadata: AttentionMetadata | DecodeMetadata,
) -> torch.Tensor:
    """The logits of one step; the attention layers read ``metadata`` from ``use_metadata``."""
    with use_metadata(metadata):
        out = model(input_ids=input_ids, position_ids=positions, logits_to_keep=logits_to_keep, use_cache=False)
    return out.logits[0]


def compile_norms(model: torch.nn.Module) -> int:
    """``torch.compile`` (dynamic shapes) every module whose class is an RMSNorm, in place:
    one compiled graph serves all of them. Returns how many were compiled."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    pending = [m for m in norms if getattr(m, "_compiled_call_impl", None) is None]  # a probe's runner did some
    if pending:
        # What ``Module.compile`` sets, from one compiled callable: one torch.compile wrapper
        # instead of one per norm (each costs its config's build).
        compiled = torch.compile(torch.nn.Module._call_impl, dynamic=True)
        for module in pending:
            module._compiled_call_impl = functools.partial(compiled, module)
    return len(norms)


def compile_layers(model: torch.nn.Module) -> int:
    """``torch.compile`` (dynamic shapes) every decoder layer in place; the paged attention
    function runs outside the compiled graphs (``torch.compiler.disable``), so each layer
    compiles to the part before it and the part after it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, torch.compiler.disable(paged_attention))
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for module in layers:
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile(dynamic=True)
    return len(layers)
