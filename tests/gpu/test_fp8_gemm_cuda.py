"""FP8 projections on CUDA (``bootstrap.engine.kernels.fp8_gemm``): the activation quantizer
bit for bit against torch; the one-row and few-rows kernels and the FP8 GEMM (row and 128 x 128
block scales) against a float64 product of the same quantized operands (block scales of two column
blocks, which cuBLASLt does not take, against the dequantized weight); each replayed inside a CUDA
graph; a load compiling every FP8 kernel the forward launches; and a 16-bit checkpoint quantized at
load on the GPU answering as its FP8 checkpoint does."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import anyio
import pytest
import torch
from helpers.fp8_checkpoints import quantized
from helpers.tiny_models import save_checkpoint

from bootstrap.api import Bootstrap
from bootstrap.config import BootstrapConfig
from bootstrap.engine.kernels import fp8_gemm
from bootstrap.engine.sampling.sampler import SamplingParams

CUDA = torch.device("cuda")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_gemm.triton is None or torch.cuda.get_device_capability() < (8, 9),
    reason="needs CUDA with FP8 (8.9+) and Triton",
)
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (384, 256)]


def weight_and_scale(n: int, k: int, block: tuple[int, int] | None, seed: int):
    torch.manual_seed(seed)
    w = (torch.randn(n, k, device=CUDA) * 64).clamp(-448, 448).to(fp8_gemm.FP8)
    shape = (math.ceil(n / block[0]), math.ceil(k / block[1])) if block else (n, 1)
    return w, (torch.rand(shape, device=CUDA) + 0.5) / k**0.5


def test_the_quantizer_equals_torchs_rounding_per_token_and_per_block():
    torch.manual_seed(0)
    x = torch.randn(37, 4096, device=CUDA, dtype=torch.bfloat16) * 3
    x[5] = 0  # a row of zeros keeps a finite scale
    q, scale = fp8_gemm.quantize(x, 4096)
    want_scale = x.float().abs().amax(1, keepdim=True).clamp(min=fp8_gemm.MIN_AMAX) / fp8_gemm.FP8_MAX
    assert torch.equal(scale, want_scale)
    assert torch.equal(
        q.view(torch.uint8), (x.float() / want_scale).clamp(-448, 448).to(fp8_gemm.FP8).view(torch.uint8)
    )
    q, scale = fp8_gemm.quantize(x, 128, pad_rows=4)
    assert q.shape == (40, 4096) and scale.shape == (40, 32) and scale.stride() == (1, 40)
    groups = x.float().view(37, 32, 128)
    block_scale = groups.abs().amax(2).clamp(min=fp8_gemm.MIN_AMAX) / fp8_gemm.FP8_MAX
    assert torch.equal(scale[:37], block_scale)
    want = (groups / block_scale[..., None]).clamp(-448, 448).to(fp8_gemm.FP8).view(37, 4096)
    assert torch.equal(q[:37].view(torch.uint8), want.view(torch.uint8)) and not q[37:].float().any()


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 16, 64, 300])
def test_a_product_is_a_float64_product_of_its_quantized_operands(rows, n, k, block):
    w, s = weight_and_scale(n, k, block, n + k + rows)
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)
    bias = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    weight = fp8_gemm.dequantize(w, s, block, torch.float64)
    kind = fp8_gemm.product(x, w, s, block)
    blocks = k != 256 and fp8_gemm.blockwise_supported(CUDA)  # 256: two column blocks, which cuBLASLt does not take
    if rows == 1:
        assert kind == "one_row"
    elif block is None:
        assert kind == ("few_rows" if rows <= fp8_gemm.FEW_ROWS else "rows")
    else:
        assert kind == ("blocks" if blocks else "few_rows" if rows <= fp8_gemm.FEW_ROWS_MAX else "dequantize")
    if kind in ("one_row", "few_rows", "dequantize"):  # weight-only: the 16-bit rows as they are
        operand = x.double()
    else:  # the row quantized as the GEMM takes it
        group = block[1] if block else k
        q, qs = fp8_gemm.quantize(x, group, pad_rows=4 if block else 1)
        operand = (q[:rows].double().view(rows, -1, group) * qs[:rows, :, None].double()).view(rows, k)
    expected = operand @ weight.T + bias.double()
    got = fp8_gemm.linear(x, w, s, block, bias)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    error = (got.double() - expected).abs().max().item()
    assert error <= 2 * torch.finfo(torch.bfloat16).eps * expected.abs().max().item() + 1e-3, error
    if 1 < rows <= fp8_gemm.FEW_ROWS_MAX:  # the few-rows kernel wherever it could run, picked or not
        expected = x.double() @ weight.T + bias.double()
        error = (fp8_gemm.few_rows(x, w, s, block, bias).double() - expected).abs().max().item()
        assert error <= 2 * torch.finfo(torch.bfloat16).eps * expected.abs().max().item() + 1e-3, error


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("rows", [1, 8, 100])
def test_a_captured_product_replays_new_inputs(rows, block):
    w, s = weight_and_scale(4096, 4096, block, 7)
    x = torch.randn(rows, 4096, device=CUDA, dtype=torch.bfloat16)
    fp8_gemm.linear(x, w, s, block)  # compiled (and the block-scale probe run) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm.linear(x, w, s, block)
    for seed in range(3):
        x.copy_(torch.randn(rows, 4096, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        assert torch.equal(out, fp8_gemm.linear(x, w, s, block))


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_loading_an_fp8_checkpoint_compiles_every_fp8_kernel_the_forward_launches(tmp_path, layout):
    """In a fresh process with an empty Triton cache: ``load_own_model`` of an FP8 checkpoint leaves
    the one-row, few-rows and quantizer kernels compiled on disk, and prefills and decode steps of
    1 to 3 rows after it (eager and through graphs of 1, 2, 4 and 64 rows) compile none again."""
    path, _ = quantized(save_checkpoint("llama", tmp_path / "llama"), tmp_path / layout, layout)
    script = f"""
import pathlib, torch
from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.models import load_own_model
def entries():
    names = ("_one_row_kernel", "_few_rows_kernel", "_quantize_kernel")
    return sorted(str(p) for p in pathlib.Path({str(tmp_path / "triton")!r}).rglob("*") if p.name.startswith(names))
model = load_own_model(pathlib.Path({str(path)!r}), torch.device("cuda"), torch.bfloat16)
after_load = entries()
cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, torch.bfloat16), 4096, 32, "cuda")
ex = create_executor(model, cache, SchedulerConfig(64, 256, 128), start=False)
for prompts in ([[5, 6, 7, 8, 9]], [[5, 6], [7, 8, 9]], [[4], [5, 6], [7, 8, 9]]):
    ex.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
ex.runner.capture_decode_graphs([1, 2, 4, 64])
ex.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4, ignore_eos=True))
ex.shutdown()
print(len(after_load), after_load == entries())
"""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    count, unchanged = done.stdout.split()[-2:]
    assert int(count) >= 3 and unchanged == "True", done.stdout


async def answer(path, **config) -> list[int]:
    settings = dict(device="cuda", dtype="bfloat16", max_num_tokens=64, max_batch_size=4, plan_cache=None)
    boot = Bootstrap(BootstrapConfig(model=str(path), **settings, **config))
    try:
        executor = await boot.build()
        rids = [
            executor.enqueue([1, 7, 9, 4, 11, 3, 200, 13][:n], SamplingParams(max_tokens=12, ignore_eos=True))
            for n in (8, 5, 3)
        ]  # three at once: decode steps of three rows, then of one
        return [list(executor.await_response(rid, 60).token_ids) for rid in rids]
    finally:
        await boot.aclose()


def test_a_checkpoint_quantized_at_load_on_the_gpu_answers_as_its_fp8_checkpoint(tmp_path):
    source = save_checkpoint("llama", tmp_path / "llama")
    channel, _ = quantized(source, tmp_path / "llama-channel", "channel")
    at_load = anyio.run(lambda: answer(source, quantization="fp8"))
    assert at_load == anyio.run(answer, channel)
    assert len({tuple(t) for t in at_load}) > 1
