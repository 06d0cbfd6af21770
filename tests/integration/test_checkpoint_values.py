"""What a checkpoint's values can break, refused with one line naming the tensor (exit status 2),
before serving: a fused projection with a part missing (q of qkv, gate of gate/up, one part's FP8
scale), FP8 weight scales that are NaN, inf, negative or 0 in each layout, FP8 KV scales outside
their range (named with the layer), and weights that are NaN or inf where they are read (at a
start, in a swap, in a weights update). Also what FP8 must get right: different key and value
scales each applied to its own half of the pool, keys past 448 x scale saturated, an all-zero row
quantized at load, a per-tensor scale stored in float32."""

from __future__ import annotations

import json
import math
from pathlib import Path

import anyio
import pytest
import torch
from helpers.broken_checkpoints import copy_checkpoint, replace_tensors
from helpers.fp8_checkpoints import quantized, with_kv_scales
from safetensors.torch import load_file

from bootstrap.api import Bootstrap, Refused
from bootstrap.cli.main import main
from bootstrap.config import BootstrapConfig
from bootstrap.engine.models import check_checkpoint
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.engine.sources.loader import ModelSourceError

Q, GATE = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"
K_SCALE = "model.layers.1.self_attn.k_proj.weight_scale"
PROMPT = [1, 7, 9, 4, 11, 3, 200, 13]


def without(name: str):
    return lambda tensors: {n: t for n, t in tensors.items() if n != name}


def run_cli(path: Path, *flags: str, capsys) -> tuple[int, str]:
    """``bootstrap run`` on ``path``: its exit status and its one ``bootstrap:`` line (asserted one)."""
    code = main(["run", "--device", "cpu", "--model", str(path), "--no-plan-cache", "--prompt", "w5 w17", *flags])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("bootstrap: ")]
    assert "Traceback" not in err and len(lines) <= 1, err
    return code, lines[0] if lines else err


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("missing", [Q, GATE])
def test_a_fused_part_missing_is_refused_from_the_folder_and_config_alone(missing, llama, tmp_path):
    path = copy_checkpoint(llama, tmp_path / "broken")
    replace_tensors(path, without(missing))
    with pytest.raises(ModelSourceError, match=f"no tensor for 1 parameter.*{missing}"):
        check_checkpoint(path, config_of(path))
    check_checkpoint(llama, config_of(llama))  # the whole checkpoint passes


@pytest.mark.parametrize("missing", [Q, GATE])
def test_a_fused_part_missing_is_exit_2_naming_the_tensor(missing, llama, tmp_path, capsys):
    path = copy_checkpoint(llama, tmp_path / "broken")
    replace_tensors(path, without(missing))
    code, line = run_cli(path, capsys=capsys)
    assert code == 2 and missing in line, line


def test_one_parts_fp8_scale_missing_is_refused_at_the_start_and_in_the_header_check(llama, tmp_path, capsys):
    path, _ = quantized(llama, tmp_path / "channel", "channel")
    replace_tensors(path, without(K_SCALE))
    with pytest.raises(ModelSourceError, match=K_SCALE):
        check_checkpoint(path, config_of(path))
    code, line = run_cli(path, capsys=capsys)
    assert code == 2 and K_SCALE in line, line


def test_a_weights_update_missing_a_fused_part_is_refused_and_changes_nothing(llama, tmp_path):
    path = copy_checkpoint(llama, tmp_path / "broken")
    replace_tensors(path, lambda t: {n: v * 2 for n, v in t.items() if n != Q})

    async def main_() -> None:
        boot = Bootstrap(BootstrapConfig(model=str(llama), device="cpu", max_num_tokens=64, plan_cache=None))
        try:
            executor = await boot.build()
            before = greedy(executor)
            with pytest.raises(Refused, match=Q.replace(".", r"\.")):
                await boot.update_weights(str(path))
            assert boot.executor is executor and greedy(executor) == before
        finally:
            await boot.aclose()

    anyio.run(main_)


def greedy(executor, prompt=PROMPT) -> list[int]:
    rid = executor.enqueue(list(prompt), SamplingParams(max_tokens=8, ignore_eos=True))
    return list(executor.await_response(rid, 60).token_ids)


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.01, 0.0])
@pytest.mark.parametrize("layout", ["channel", "tensor", "block"])
def test_an_fp8_weight_scale_that_is_not_finite_and_positive_is_exit_2_naming_it(
    layout, value, llama, tmp_path, capsys
):
    path, _ = quantized(llama, tmp_path / layout, layout)
    name = "model.layers.1.mlp.down_proj." + ("weight_scale_inv" if layout == "block" else "weight_scale")

    def spoil(tensors: dict) -> dict:
        scale = tensors[name].clone()
        scale.view(-1)[-1] = value
        return tensors | {name: scale}

    replace_tensors(path, spoil)
    code, line = run_cli(path, capsys=capsys)
    assert code == 2 and name in line and "finite" in line, line


@pytest.mark.parametrize("value", [math.nan, 0.0, -0.5, math.inf, 1e30, 1e-30])
@pytest.mark.parametrize("kind", ["k_scale", "v_scale"])
def test_an_fp8_kv_scale_outside_its_range_is_exit_2_naming_layer_and_tensor(kind, value, llama, tmp_path, capsys):
    path = with_kv_scales(llama, tmp_path / "scaled", 0.5, 2)
    name = f"model.layers.1.self_attn.{kind}"
    replace_tensors(path, lambda t: t | {name: torch.tensor(value)})
    code, line = run_cli(path, "--kv-cache-dtype", "fp8", capsys=capsys)
    assert code == 2 and name in line and "layer 1" in line and "1e-06..1000" in line, line
    assert "load_model" not in line or "read" not in line


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    "flags", [(), ("--dtype", "bfloat16"), ("--quantization", "fp8")], ids=["read", "converted", "quantized"]
)
def test_a_non_finite_weight_is_exit_2_naming_it(flags, value, llama, tmp_path, capsys):
    path = copy_checkpoint(llama, tmp_path / "broken")
    name = "model.layers.1.mlp.up_proj.weight"

    def spoil(tensors: dict) -> dict:
        weight = tensors[name].clone()
        weight[77, 5] = value
        return tensors | {name: weight}

    replace_tensors(path, spoil)
    code, line = run_cli(path, *flags, capsys=capsys)
    assert code == 2 and name in line and "not finite" in line, line


@pytest.mark.parametrize("operation", ["swap", "update_weights"])
def test_non_finite_weights_are_refused_by_a_swap_and_a_weights_update(operation, llama, tmp_path):
    path = copy_checkpoint(llama, tmp_path / "broken")
    name = "model.norm.weight"
    replace_tensors(path, lambda t: t | {name: torch.full_like(t[name], math.nan)})

    async def main_() -> str:
        config = BootstrapConfig(model=str(llama), device="cpu", max_num_tokens=64, plan_cache=None)
        boot = Bootstrap(config)
        try:
            await boot.build()
            with pytest.raises(Exception) as info:
                if operation == "swap":
                    await boot.swap(config.model_copy(update={"model": str(path)}))
                else:
                    await boot.update_weights(str(path))
            return f"{info.value} {getattr(info.value, 'cause', '')}"
        finally:
            await boot.aclose()

    cause = anyio.run(main_)
    assert name in cause and "not finite" in cause, cause


async def first_layer_kv(path: Path, **config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Layer 0's keys and values in the pool after one prompt (max_tokens 1: only the prompt
    is written; layer 0's keys and values depend on the tokens alone), the pool's scales, tokens."""
    settings = dict(device="cpu", max_num_tokens=16, max_batch_size=4, plan_cache=None, prefix_caching=False)
    boot = Bootstrap(BootstrapConfig(model=str(path), **{**settings, **config}))
    try:
        executor = await boot.build()
        tokens = greedy(executor, PROMPT * 2)
        pool = executor.runner.kv_cache
        k, v = (part.reshape(-1, *part.shape[2:]).clone() for part in (pool.k_cache(0), pool.v_cache(0)))
        return k, v, pool.scales.clone(), tokens
    finally:
        await boot.aclose()


def e4m3_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at 448 (written out here, not through the engine's code)."""
    r = x.double() / scale
    return torch.where(r.abs() > 448, r.sign() * 448, r).float().to(torch.float8_e4m3fn)


def test_different_key_and_value_scales_each_scale_their_own_half_and_keys_past_448_saturate(llama, tmp_path):
    keys, values, _, _ = anyio.run(first_layer_kv, llama)  # float32 pool: the keys and values as computed
    written = keys.flatten(1).abs().amax(dim=1) > 0
    k_amax, v_amax = keys[written].abs().max().item(), values[written].abs().max().item()
    k_scale, v_scale = k_amax / (448 * 4), v_amax / (448 / 4)  # keys: the largest past 448 x scale
    path = with_kv_scales(llama, tmp_path / "scaled", k_scale, 2, value_scale=v_scale)
    k8, v8, scales, _ = anyio.run(lambda: first_layer_kv(path, kv_cache_dtype="fp8"))
    assert torch.equal(scales, torch.tensor([[k_scale] * 2, [v_scale] * 2], dtype=torch.float32))
    want_k, want_v = e4m3_reference(keys[written], k_scale), e4m3_reference(values[written], v_scale)
    assert (want_k.float().abs() == 448).sum() > 0  # some keys saturated
    assert torch.equal(k8[written].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v8[written].view(torch.uint8), want_v.view(torch.uint8))


async def loaded_params(path: Path, **config) -> tuple[list[int], dict[str, torch.Tensor]]:
    boot = Bootstrap(BootstrapConfig(model=str(path), device="cpu", max_num_tokens=64, plan_cache=None, **config))
    try:
        executor = await boot.build()
        model = boot.pipeline.artifacts["loaded"].handle.target.model
        return greedy(executor), {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        await boot.aclose()


def test_an_all_zero_row_quantized_at_load_gets_a_finite_scale_and_the_channel_checkpoints_tokens(llama, tmp_path):
    path = copy_checkpoint(llama, tmp_path / "zero-row")
    replace_tensors(path, lambda t: t | {GATE: torch.cat([torch.zeros(1, 64), t[GATE][1:]])})
    channel, _ = quantized(path, tmp_path / "channel", "channel")
    tokens, params = anyio.run(lambda: loaded_params(path, quantization="fp8"))
    want, offline = anyio.run(loaded_params, channel)
    scale = params["model.layers.1.mlp.gate_up_proj.weight_scale"]
    assert scale[0].item() > 0 and all(torch.isfinite(p.float()).all() for p in params.values())
    assert torch.equal(scale, offline["model.layers.1.mlp.gate_up_proj.weight_scale"])
    assert tokens == want


def test_a_per_tensor_scale_stored_in_float32_answers_as_its_dequantized_weights(llama, tmp_path):
    fp8, plain = quantized(llama, tmp_path / "tensor32", "tensor", tensor_scale=torch.float32)
    assert load_file(fp8 / "model.safetensors")[K_SCALE].dtype == torch.float32
    tokens, params = anyio.run(loaded_params, fp8)
    want, _ = anyio.run(loaded_params, plain)
    assert tokens == want
    scales = params["model.layers.1.self_attn.qkv_proj.weight_scale"]
    assert torch.equal(scales[64:96], load_file(fp8 / "model.safetensors")[K_SCALE].expand(32, 1))
