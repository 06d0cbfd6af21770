"""An e4m3 KV cache on CUDA (``kv_cache_dtype: fp8``): the KV-write kernel stores exactly torch's
rounding of the keys over their scale; the paged decode kernel reads them back scaled, against
a float64 computation over the same rounded values; and the engine, its decode steps replayed as
CUDA graphs, answers with a checkpoint's scales of 0.5 as with scales of 1.0 (a power of two:
the same rounding), which a scale lost anywhere on the way would change."""

from __future__ import annotations

import anyio
import pytest
import torch
from helpers.tiny_models import save_checkpoint

from bootstrap.api import Bootstrap
from bootstrap.config import BootstrapConfig
from bootstrap.engine.kernels import paged_kv
from bootstrap.engine.layers.fp8 import FP8, to_fp8
from bootstrap.engine.sampling.sampler import SamplingParams

CUDA = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or paged_kv.triton is None or torch.cuda.get_device_capability() < (8, 9),
    reason="needs CUDA with FP8 (8.9+) and Triton",
)


def test_the_write_kernel_stores_torchs_rounding_of_keys_over_their_scale():
    torch.manual_seed(0)
    kv_heads, head_dim, slots = 8, 128, 64 * 16
    key = torch.randn(40, kv_heads, head_dim, device=CUDA, dtype=torch.bfloat16) * 300  # some past 448 * 0.5
    value = torch.randn(40, kv_heads, head_dim, device=CUDA, dtype=torch.bfloat16)
    k_cache = torch.zeros(64, 16, kv_heads, head_dim, device=CUDA, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    scales = (torch.tensor(0.5, device=CUDA), torch.tensor(0.03, device=CUDA))
    rows, where = torch.arange(40, device=CUDA), torch.randperm(slots, device=CUDA)[:40]
    paged_kv.write_kv(key, value, rows, where, k_cache, v_cache, scales)
    stored_k = k_cache.view(-1, kv_heads, head_dim)[where].view(torch.uint8)
    stored_v = v_cache.view(-1, kv_heads, head_dim)[where].view(torch.uint8)
    assert torch.equal(stored_k, to_fp8(key, scales[0]).view(torch.uint8))
    assert torch.equal(stored_v, to_fp8(value, scales[1]).view(torch.uint8))


@pytest.mark.parametrize("dots", [None, torch.float16])
@pytest.mark.parametrize("splits, step", [(1, 1), (4, 1), (1, 2), (4, 4)])
def test_the_decode_kernel_reads_the_pool_scaled_back(splits, step, dots):
    """Also with 2 and 4 blocks an iteration and float16 dots (the benchmark's to vary)."""
    torch.manual_seed(1)
    rows, heads, kv_heads, head_dim, tpb, blocks = 3, 32, 8, 128, 16, 40
    scales = (torch.tensor(0.25, device=CUDA), torch.tensor(0.5, device=CUDA))
    k = torch.randn(blocks, tpb, kv_heads, head_dim, device=CUDA)
    v = torch.randn_like(k)
    k8, v8 = to_fp8(k, scales[0]), to_fp8(v, scales[1])
    tables = torch.randperm(blocks, device=CUDA)[: rows * 12].view(rows, 12)
    lens = torch.tensor([190, 17, 100], device=CUDA)
    q = torch.randn(rows, heads, head_dim, device=CUDA, dtype=torch.bfloat16)
    got = paged_kv.paged_decode(
        q, k8, v8, tables, lens, None, splits=splits, scales=scales, blocks_per_step=step, dot_dtype=dots
    )
    kd, vd = (k8.double() * scales[0].double()), (v8.double() * scales[1].double())
    for row in range(rows):
        n = int(lens[row])
        slots = torch.stack([tables[row][p // tpb] * tpb + p % tpb for p in range(n)])
        keys = kd.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)
        values = vd.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)
        weights = (torch.einsum("hd,khd->hk", q[row].double(), keys) * head_dim**-0.5).softmax(-1)
        want = torch.einsum("hk,khd->hd", weights, values)
        torch.testing.assert_close(got[row].double(), want, atol=2e-2, rtol=2e-2)


async def answer(path, **config) -> list[list[int]]:
    settings = dict(device="cuda", dtype="bfloat16", max_num_tokens=64, max_batch_size=4, plan_cache=None)
    boot = Bootstrap(BootstrapConfig(model=str(path), kv_cache_dtype="fp8", **settings, **config))
    try:
        executor = await boot.build()
        assert boot.report().to_dict()["plan"]["kv_dtype"] == "fp8"
        prompts = [[1, 7, 9, 4, 11, 3, 200, 13, 5, 6, 7, 8, 9, 10, 11, 12, 40], [5, 9, 2, 77]]
        rids = [executor.enqueue(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
        return [list(executor.await_response(rid, 60).token_ids) for rid in rids]
    finally:
        await boot.aclose()


def test_the_engine_with_graphs_applies_a_checkpoints_scales(tmp_path):
    from safetensors.torch import load_file, save_file

    source = save_checkpoint("llama", tmp_path / "llama")
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for item in source.iterdir():
        (scaled / item.name).write_bytes(item.read_bytes())
    tensors = load_file(source / "model.safetensors")
    tensors |= {f"model.layers.{i}.self_attn.{k}": torch.tensor(0.5) for i in range(2) for k in ("k_scale", "v_scale")}
    save_file(tensors, scaled / "model.safetensors", metadata={"format": "pt"})
    assert anyio.run(answer, scaled) == anyio.run(answer, source)
