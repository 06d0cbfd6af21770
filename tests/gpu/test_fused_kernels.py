"""The own model code's Triton kernels (``bootstrap.engine.kernels.fused``) against the eager
PyTorch code they replace (the layers' CPU path, run here on the same CUDA tensors), and the own
model on CUDA, kernels and decode graphs included, against transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen3Config

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.kernels import fused, paged_kv
from bootstrap.engine.layers.norm import RMSNorm
from bootstrap.engine.layers.rotary import Rotary, apply_rotary, rotate_qk
from bootstrap.engine.models import load_own_model
from bootstrap.engine.models.decoder import ACTIVATIONS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or fused.triton is None, reason="needs CUDA and Triton")
CUDA = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to two units in the last place of the dtype: the kernels' float32 math (one
    reciprocal square root, one reduction order, Triton's exp) may round an element the other way."""
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, expected, rtol=max(2 * eps, 1.3e-6), atol=max(2 * eps, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, rows", [(4096, 1), (4096, 67), (128, 300), (80, 5)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_with_and_without_the_residual_matches_eager(dtype, dim, rows, offset):
    torch.manual_seed(dim + rows)
    norm = RMSNorm(dim, 1e-6, offset=offset, device=CUDA).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    x, residual = (torch.randn(rows, dim, device=CUDA, dtype=dtype) * 3 for _ in range(2))
    out, summed = fused.rms_norm(x, norm.weight, norm.eps, offset, residual)
    assert torch.equal(summed, x + residual)
    close(out, norm._norm(x + residual))
    close(fused.rms_norm(x, norm.weight, norm.eps, offset)[0], norm._norm(x))
    assert torch.equal(norm(x, residual)[1], summed)  # the module takes the kernel on CUDA


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (4, 2, 16), (8, 1, 80)])
def test_rotary_in_place_on_views_of_one_projection_matches_eager(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(heads)
    tokens = 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=CUDA, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    rotary = Rotary(head_dim, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    rotary.reset(CUDA)
    cos, sin = rotary(torch.arange(100, 100 + tokens, device=CUDA), dtype)
    expected_q, expected_k, before_v = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()
    got_q, got_k = rotate_qk(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    close(got_q, expected_q)
    close(got_k, expected_k)
    assert torch.equal(v, before_v)  # the values beside them untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(fused.ACTIVATION_IDS))
def test_activation_times_up_matches_eager(dtype, activation):
    torch.manual_seed(1)
    gate_up = torch.randn(19, 2 * 3000, device=CUDA, dtype=dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    close(fused.act_mul(gate_up, activation), ACTIVATIONS[activation](gate) * up)


@pytest.mark.parametrize("window", [None, 300])
def test_paged_decode_split_in_runs_matches_whole_rows_in_a_graph(window):
    """An 8B model's attention shape (32 query heads on 8 KV heads of 128), rows of 1 to 2,048
    tokens in a table 64 blocks wide: the kernel split in runs (on an H200: 16 runs for 1 row, 13
    for the 5 rows of a verify pass) and merged, replayed as a CUDA graph after the lengths
    change, matches float64 attention as closely as whole rows do."""
    torch.manual_seed(5)
    heads, kv_heads, dim, tpb, width = 32, 8, 128, 32, 64
    kc = torch.randn(6 * width, tpb, kv_heads, dim, device=CUDA, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    for rows in (1, 5):
        tables = torch.randperm(6 * width, device=CUDA)[: rows * width].view(rows, width)
        lens = torch.zeros(rows, dtype=torch.long, device=CUDA)
        q = torch.randn(rows, heads, dim, device=CUDA, dtype=torch.bfloat16)
        assert paged_kv.num_splits(rows * kv_heads, width, paged_kv.programs_wanted(CUDA)) > 1
        graph, out = torch.cuda.CUDAGraph(), None
        paged_kv.paged_decode(q, kc, vc, tables, lens.fill_(1), None, window)  # compiled before capture
        with torch.cuda.graph(graph):
            out = paged_kv.paged_decode(q, kc, vc, tables, lens, None, window)
        for lengths in ([1, 31, 700, 1000, 2048][:rows], [37, 33, 65, 999, 2][:rows]):
            lens.copy_(torch.tensor(lengths))
            graph.replay()
            whole = paged_kv.paged_decode(q, kc, vc, tables, lens, None, window, splits=1)
            for row, n in enumerate(lengths):
                slots = tables[row, torch.arange(n, device=CUDA) // tpb] * tpb + torch.arange(n, device=CUDA) % tpb
                k = kc.view(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
                v = vc.view(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, 1)
                s = torch.einsum("hd,khd->hk", q[row].double(), k) * dim**-0.5
                if window:
                    s = s.masked_fill(torch.arange(n, device=CUDA) < n - window, float("-inf"))
                expected = torch.einsum("hk,khd->hd", s.softmax(-1), v)
                split_error = (out[row].double() - expected).abs().max().item()
                whole_error = (whole[row].double() - expected).abs().max().item()
                assert split_error <= max(2 * whole_error, 1e-2), (rows, row, n, split_error, whole_error)


CONFIGS = {
    "llama": lambda: LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    "qwen3": lambda: Qwen3Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
    ),
    "gemma2": lambda: Gemma2Config(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=16,
        query_pre_attn_scalar=64,
        max_position_embeddings=512,
    ),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_own_model_on_cuda_gives_transformers_greedy_tokens_through_graphs(family, tmp_path):
    """float32 on CUDA (no TF32): the kernels, the paged decode kernel and the decode graphs
    together give transformers' 32 greedy tokens for 4 prompts."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(7)
    reference = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.mul_(4.0 if param.dim() > 1 else 1.0)
    reference.save_pretrained(tmp_path)
    reference = reference.to(CUDA)
    model = load_own_model(tmp_path, CUDA, torch.float32)
    cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, torch.float32), 4096, 16, CUDA)
    ex = create_executor(model, cache, SchedulerConfig(8, 256, 128), start=False)
    try:
        ex.runner.capture_decode_graphs([1, 2, 4])
        prompts = [
            torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 30, 9)
        ]
        responses = ex.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        for prompt, response in zip(prompts, responses):
            with torch.no_grad():
                greedy = reference.generate(
                    torch.tensor([prompt], device=CUDA), do_sample=False, max_new_tokens=32, min_new_tokens=32
                )[0, len(prompt) :].tolist()
            assert response.token_ids == greedy
    finally:
        ex.shutdown()


def test_loading_compiles_every_kernel_the_forward_launches(tmp_path):
    """In a fresh process with an empty Triton cache: ``load_own_model`` (which compiles ahead
    while it reads the weights) leaves the fused kernels and the paged decode and KV-write
    kernels compiled on disk, and prefills and decode steps after it (eager and through graphs,
    batches of 1 to 3 rows) compile none of them again."""
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(CONFIGS["qwen3"]()).save_pretrained(tmp_path / "ckpt")
    script = f"""
import pathlib, torch
from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.models import load_own_model
def fused_entries():
    names = ("_rms_norm_kernel", "_rotary_kernel", "_act_mul_kernel", "_paged_decode_kernel", "_write_kv_kernel",
             "_merge_splits_kernel", "_gemv_kernel")
    return sorted(str(p) for p in pathlib.Path({str(tmp_path / "triton")!r}).rglob("*") if p.name.startswith(names))
model = load_own_model(pathlib.Path({str(tmp_path / "ckpt")!r}), torch.device("cuda"), torch.bfloat16)
after_load = fused_entries()
cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, torch.bfloat16), 1024, 32, "cuda")
ex = create_executor(model, cache, SchedulerConfig(4, 256, 128), start=False)
for prompts in ([[5, 6, 7, 8, 9]], [[5, 6], [7, 8, 9]], [[4], [5, 6], [7, 8, 9]]):
    ex.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
ex.runner.capture_decode_graphs([1, 2, 4])
ex.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4, ignore_eos=True))
ex.shutdown()
print(len(after_load), after_load == fused_entries())
"""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    count, unchanged = done.stdout.split()[-2:]
    assert int(count) >= 7 and unchanged == "True", done.stdout
