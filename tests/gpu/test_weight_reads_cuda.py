"""Checkpoint bytes read to the GPU through page-locked staging (``engine.models.byte_reads``):
exact, whatever the piece size, with every reader joined and every buffer given back."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bootstrap.engine.models import load_own_model
from bootstrap.engine.models.byte_reads import ByteRange, read_ranges

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("bootstrap-weights")]


@pytest.mark.parametrize("piece_bytes", [4096, 1 << 20, 64 << 20])
def test_ranges_land_on_the_gpu_byte_for_byte(tmp_path, piece_bytes):
    blob = torch.randint(0, 256, (9 << 20,), dtype=torch.uint8)
    file = tmp_path / "blob"
    file.write_bytes(blob.numpy().tobytes())
    cuts = [(0, 3 << 20), (5, 1 << 20), (4 << 20, 5 << 20), (123, 0), (7, 333)]
    targets = [torch.zeros(n, dtype=torch.uint8, device=CUDA) for _, n in cuts]
    read_ranges([ByteRange(file, o, t) for (o, _), t in zip(cuts, targets)], threads=4, piece_bytes=piece_bytes)
    for (offset, n), target in zip(cuts, targets):
        assert torch.equal(target.cpu(), blob[offset : offset + n])
    assert readers() == []


def test_a_failed_read_on_the_gpu_joins_every_reader(tmp_path):
    file = tmp_path / "short"
    file.write_bytes(bytes(1 << 20))
    with pytest.raises(ValueError, match="ends at byte"):
        read_ranges(
            [ByteRange(file, 0, torch.empty(3 << 20, dtype=torch.uint8, device=CUDA))], threads=3, piece_bytes=1 << 18
        )
    assert readers() == []
    torch.cuda.synchronize()  # no copy left in flight into the freed buffers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_own_model_loaded_on_the_gpu_holds_the_checkpoint_exactly(tmp_path, dtype):
    torch.manual_seed(11)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    reference = AutoModelForCausalLM.from_config(config).to(dtype)
    reference.save_pretrained(tmp_path, max_shard_size="1MB")
    model = load_own_model(tmp_path, CUDA, dtype)
    expected = reference.state_dict()
    attention = model.model.layers[2].self_attn
    _q, k, _v = attention.qkv_proj.split(attention.qkv_proj.weight.T)
    assert torch.equal(k.T.cpu(), expected["model.layers.2.self_attn.k_proj.weight"])
    assert torch.equal(model.lm_head.weight.cpu(), expected["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight.cpu(), expected["model.embed_tokens.weight"])
    assert readers() == []


def test_triton_starts_in_a_thread_without_importing_torch():
    """In a fresh process: ``triton_start`` imports Triton and computes its cache key without a
    torch module, so it can run beside ``import torch``; the key is then cached for the kernels."""
    import subprocess
    import sys

    script = """
import sys
from bootstrap.engine.kernels import triton_start
assert triton_start.begin_for("cuda", "native", 1) and not triton_start.begin_for("cpu", "native", 1)
triton_start.wait()
torch_modules = [m for m in sys.modules if m.partition(".")[0] == "torch"]
try:
    from triton.runtime.cache import triton_key
except ImportError:
    from triton.compiler.compiler import triton_key
print(torch_modules, triton_key.cache_info().currsize)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "1"]
