"""FP8 checkpoints on the CPU engine (``layers.fp8``): each layout (channel and per-tensor
scales from compressed-tensors, 16 x 16 blocks of block-wise fp8) loads into the own model code
of each tiny family with its projections in e4m3, and answers the greedy tokens of the same
weights dequantized into a 16-bit checkpoint. ``quantization: fp8`` quantizes a 16-bit
checkpoint as it loads into exactly the channel checkpoint's weights and scales."""

from __future__ import annotations

import json

import anyio
import pytest
import torch
from helpers.fp8_checkpoints import quantized
from helpers.tiny_models import save_checkpoint
from safetensors.torch import save_file

from bootstrap.api import Bootstrap
from bootstrap.capacity.presets import MODEL_PRESETS
from bootstrap.config import BootstrapConfig
from bootstrap.engine.sampling.sampler import SamplingParams

PROMPT = [1, 7, 9, 4, 11, 3, 200, 13]


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"]


async def answer(path, **config) -> tuple[list[int], dict[str, torch.dtype]]:
    tokens, params = await answer_and_weights(path, **config)
    return tokens, {n: p.dtype for n, p in params.items() if n.endswith("proj.weight")}


async def answer_and_weights(path, **config) -> tuple[list[int], dict[str, torch.Tensor]]:
    boot = Bootstrap(BootstrapConfig(model=str(path), device="cpu", max_num_tokens=64, max_batch_size=4, **config))
    try:
        executor = await boot.build()
        model = boot.pipeline.artifacts["loaded"].handle.target.model
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        rid = executor.enqueue(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
        return list(executor.await_response(rid, 60).token_ids), params
    finally:
        await boot.aclose()


@pytest.mark.parametrize("layout", ["channel", "tensor", "block"])
@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp8_checkpoint_answers_as_its_dequantized_weights(family, layout, tmp_path):
    source = save_checkpoint(family, tmp_path / family)
    fp8, plain = quantized(source, tmp_path / f"{family}-{layout}", layout)
    tokens, dtypes = anyio.run(answer, fp8)
    want, plain_dtypes = anyio.run(answer, plain)
    assert tokens == want
    assert set(dtypes.values()) == {torch.float8_e4m3fn} and torch.float8_e4m3fn not in plain_dtypes.values()


@pytest.mark.parametrize("family", FAMILIES)
def test_quantizing_at_load_gives_the_channel_checkpoints_weights_and_tokens(family, tmp_path):
    source = save_checkpoint(family, tmp_path / family)
    channel, _ = quantized(source, tmp_path / f"{family}-channel", "channel")
    tokens, weights = anyio.run(lambda: answer_and_weights(source, quantization="fp8"))
    want, offline = anyio.run(answer_and_weights, channel)
    assert tokens == want
    assert weights.keys() == offline.keys() and any(w.dtype == torch.float8_e4m3fn for w in weights.values())
    for name, weight in weights.items():
        assert weight.dtype == offline[name].dtype and torch.equal(weight.float(), offline[name].float()), name


@pytest.mark.parametrize(
    ("source", "named"),
    [("random:smollm2-135m", "is drawn at random"), ("mixtral", "needs a model on the engine's own code")],
)
def test_quantization_fp8_of_what_it_cannot_read_is_refused_in_resolve_classes(source, named, tmp_path):
    from bootstrap.pipeline.runner import StageFailed

    if source == "mixtral":  # a family the own code does not run: config.json is all resolve_classes reads
        source = str(tmp_path / "mixtral")
        (tmp_path / "mixtral").mkdir()
        (tmp_path / "mixtral" / "config.json").write_text(json.dumps(dict(MODEL_PRESETS["mixtral-8x7b"])))
        save_file({"lm_head.weight": torch.zeros(1)}, tmp_path / "mixtral" / "model.safetensors")  # never read

    async def build() -> None:
        boot = Bootstrap(BootstrapConfig(model=source, device="cpu", quantization="fp8", plan_cache=None))
        try:
            await boot.build()
        finally:
            await boot.aclose()

    with pytest.raises(StageFailed) as info:
        anyio.run(build)
    assert info.value.stage == "resolve_classes" and named in str(info.value.cause)
