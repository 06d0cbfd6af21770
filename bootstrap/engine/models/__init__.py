"""The engine's own model code, for the families it serves without transformers on the hot path.

``decoder`` is one dense decoder for llama (SmolLM2 is one), mistral, qwen2, qwen3, gemma and
gemma2; ``weights`` fills it from safetensors, ``reload`` again from another checkpoint in place,
and ``residency`` moves its parameters to host memory and back (sleep and wake).
``own_model_problem`` says why a checkpoint stays on the transformers path instead (another
family, a rotary scaling not implemented here, an activation other than SiLU or GELU, MLP
biases); the loader says so once in the log and loads it through transformers.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from bootstrap.capacity.config_json import parse_config
from bootstrap.capacity.quantization import AT_LOAD
from bootstrap.capacity.shape import ModelConfigError
from bootstrap.engine.layers.linear import Shard
from bootstrap.engine.layers.rotary import rope_scaling_problem
from bootstrap.engine.models.decoder import ACTIVATIONS, activation_name
from bootstrap.engine.models.files import ModelSourceError, exists, read_json

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
log = logging.getLogger(__name__)


def own_model_problem(cfg: dict[str, Any]) -> str | None:
    """Why the engine's own code does not run this config.json (None: it does)."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        return f"model_type {model_type!r} (own code for: {', '.join(FAMILIES)})"
    if activation_name(cfg) not in ACTIVATIONS:
        return f"activation {activation_name(cfg)!r} (own code: {', '.join(ACTIVATIONS)})"
    if cfg.get("use_bidirectional_attention"):
        return "use_bidirectional_attention"
    if cfg.get("mlp_bias"):
        return "mlp_bias"
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        return f"partial_rotary_factor {cfg['partial_rotary_factor']}"
    return rope_scaling_problem(cfg.get("rope_scaling") or cfg.get("rope_parameters"))


def load_own_model(
    path: Path,
    device: torch.device,
    dtype: torch.dtype | None,
    shard: Shard = Shard(),
    background: bool = False,
    quantize: str | None = None,
) -> torch.nn.Module | None:
    """The checkpoint at ``path`` in the engine's own model code (this rank's part of it under
    tensor parallelism; ``quantize`` "fp8": 16-bit projections in FP8, ``build_own_model``), or
    None (said once in the log) when it stays on the transformers path."""
    from bootstrap.engine.models.compile_ahead import compiling_ahead
    from bootstrap.engine.models.weights import load_weights, safetensors_files

    cfg = read_json(path / "config.json")
    files = safetensors_files(path)
    problem = own_model_problem(cfg) or (None if files else "no safetensors weights")
    if problem is None:
        try:
            model = build_own_model(cfg, device, dtype, shard, _generation_eos(path), quantize)
        except ModelConfigError as exc:
            problem = str(exc)
    if problem is not None:
        log.info("model %s loads through transformers: %s", path, problem)
        return None
    if background:  # the headers checked now; the bytes arrive while the caller goes on (``reading``)
        from bootstrap.engine.models.reading import BackgroundRead
        from bootstrap.engine.models.weights import plan_weights

        model.reading = BackgroundRead(plan_weights(model, files), model)
        return model.eval()
    with compiling_ahead(model):  # Triton's first compile of the kernels, while the weights are read
        load_weights(model, files)
    return model.eval()


def check_checkpoint(
    path: Path,
    cfg: dict[str, Any],
    dtype: torch.dtype | None = None,
    shard: Shard = Shard(),
    quantize: str | None = None,
) -> None:
    """Everything the checkpoint directory ``path`` shows without its weights, against the model
    of config.json ``cfg`` (built on the meta device: nothing allocated): every header, every
    parameter and every part of a fused one filled (``weights.check_weights``), its FP8 weight
    and KV scales' values (``scales``). ``ModelSourceError`` naming the tensor; a swap's check
    before it drains, as a start's and a weights update's before they read."""
    from bootstrap.engine.models.kv_scales import checkpoint_kv_scales
    from bootstrap.engine.models.weights import check_weights, safetensors_files

    files = safetensors_files(path)
    if not files:
        raise ModelSourceError(f"{path}: no safetensors files")
    model = build_own_model(cfg, torch.device("meta"), dtype, shard, None, quantize)
    check_weights(model, files)
    checkpoint_kv_scales(files, model.config.num_hidden_layers)


def build_own_model(
    cfg: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype | None,
    shard: Shard = Shard(),
    generation_eos: int | list[int] | None = None,
    quantize: str | None = None,
) -> torch.nn.Module:
    """The model of ``config.json`` (``cfg``) in the own code, on ``device`` in ``dtype`` (None:
    the config's), its parameters uninitialised; ``ModelConfigError`` for a config it cannot read.
    Its projections are FP8 where the checkpoint's are, or all of them with ``quantize`` "fp8"
    (``capacity.quantization.AT_LOAD``: the loader quantizes the 16-bit weights as it reads)."""
    from bootstrap.engine.models.decoder import DecoderConfig, DecoderLM

    shape = parse_config(cfg)
    config = DecoderConfig.from_shape(shape, cfg)
    dtype = dtype or getattr(torch, config.torch_dtype or "float32")
    # Built on meta by argument, not under ``torch.device("meta")``: that mode routes the
    # initialisers through torch's Python references, which import torch._dynamo (slow to import).
    model = DecoderLM(config, generation_eos=generation_eos, device="meta", shard=shard).to(dtype)
    quantization = shape.quantization or (AT_LOAD if quantize == "fp8" else None)
    if quantization is not None and quantization.fp8:
        fp8_projections(model, quantization)
    materialize(model, device)
    model.model.rotary.reset(device)  # float32 frequencies on the device
    return model


def fp8_projections(model: torch.nn.Module, quantization: Any) -> None:
    """The projections the checkpoint stores in FP8 (all but what ``ignore`` names) made so
    (``layers.fp8``), by the checkpoint's names of their parts."""
    from bootstrap.engine.layers.fp8 import make_fp8
    from bootstrap.engine.layers.linear import FusedLinear, RowLinear

    for name, module in model.named_modules():
        if isinstance(module, FusedLinear | RowLinear):
            parts = (
                [name.rpartition(".")[0] + "." + p for p in module.parts] if isinstance(module, FusedLinear) else [name]
            )
            kept = [p for p in parts if quantization.ignores(p)]
            if kept and len(kept) < len(parts):
                raise ModelConfigError(f"quantization_config: ignore names {kept[0]} but not the parts fused with it")
            if not kept:
                make_fp8(module, quantization.block)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter uninitialised storage on ``device`` (a tied one stays shared).
    Not ``Module.to_empty``: ``empty_like`` of a meta tensor goes through torch's Python
    references, which import sympy (slow to import)."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                if id(param) not in made:
                    made[id(param)] = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False
                    )
                module._parameters[name] = made[id(param)]


def _generation_eos(path: Path) -> int | list[int] | None:
    file = path / "generation_config.json"
    return read_json(file).get("eos_token_id") if exists(file) else None
