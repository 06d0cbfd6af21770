"""FP8 checkpoints on the CPU engine (``layers.fp8``): each layout (channel and per-tensor
scales from compressed-tensors, 16 x 16 blocks of block-wise fp8) loads into the own model code
of each tiny family with its projections in e4m3, and answers the greedy tokens of the same
weights dequantized into a 16-bit checkpoint."""

from __future__ import annotations

import anyio
import pytest
import torch
from helpers.fp8_checkpoints import quantized
from helpers.tiny_models import save_checkpoint

from bootstrap.api import Bootstrap
from bootstrap.config import BootstrapConfig
from bootstrap.engine.sampling.sampler import SamplingParams

PROMPT = [1, 7, 9, 4, 11, 3, 200, 13]


async def answer(path) -> tuple[list[int], dict[str, torch.dtype]]:
    boot = Bootstrap(BootstrapConfig(model=str(path), device="cpu", max_num_tokens=64, max_batch_size=4))
    try:
        executor = await boot.build()
        model = boot.pipeline.artifacts["loaded"].handle.target.model
        dtypes = {n: p.dtype for n, p in model.named_parameters() if n.endswith("proj.weight")}
        rid = executor.enqueue(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
        return list(executor.await_response(rid, 60).token_ids), dtypes
    finally:
        await boot.aclose()


@pytest.mark.parametrize("layout", ["channel", "tensor", "block"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_an_fp8_checkpoint_answers_as_its_dequantized_weights(family, layout, tmp_path):
    source = save_checkpoint(family, tmp_path / family)
    fp8, plain = quantized(source, tmp_path / f"{family}-{layout}", layout)
    tokens, dtypes = anyio.run(answer, fp8)
    want, plain_dtypes = anyio.run(answer, plain)
    assert tokens == want
    assert set(dtypes.values()) == {torch.float8_e4m3fn} and torch.float8_e4m3fn not in plain_dtypes.values()
