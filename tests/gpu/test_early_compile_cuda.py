"""The kernels' first compile begun as the backend is made (``backends.native.early_compile``):
in a fresh process on an empty Triton cache, ``NativeBackend.for_config`` compiles what the load
would, from the checkpoint's config.json alone, before any stage; the load after it (its own
compile-ahead) and a generation through the stages then add nothing to the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.tiny_models import CHAT_TEMPLATE, save_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = """
import json, pathlib, sys, anyio
from bootstrap.api import Bootstrap
from bootstrap.backends.native.backend import NativeBackend
from bootstrap.config import BootstrapConfig
from bootstrap.engine.models import compile_ahead
from bootstrap.engine.sampling.sampler import SamplingParams
cache, model = pathlib.Path(sys.argv[1]), sys.argv[2]
def compiled():
    return sorted(p.name for p in cache.rglob("*.cubin"))
config = BootstrapConfig(model=model, device="cuda", max_batch_size=4, max_num_tokens=64, max_seq_len=256,
                         plan_cache=None)
backend = NativeBackend.for_config(config)
before_stages = compile_ahead._early is not None
compile_ahead._early.join()
early = compiled()
async def generate():
    boot = Bootstrap(config, backend=backend)
    try:
        executor = await boot.build()
        rid = executor.enqueue([1, 7, 9, 4, 11], SamplingParams(max_tokens=6, ignore_eos=True))
        return list(executor.await_response(rid, 60).token_ids)
    finally:
        await boot.aclose()
tokens = anyio.run(generate)
print(json.dumps({"begun": before_stages, "early": early, "after": compiled(), "tokens": tokens}))
"""


@pytest.mark.parametrize("dtype", ["auto", "float16"])
def test_the_backend_compiles_the_load_s_kernels_before_any_stage(tmp_path, dtype):
    """``auto``: the checkpoint's float32 gives bfloat16 on CUDA (``cuda_default_dtype``), as
    ``resolve_classes`` picks it; ``float16`` asked: the early compile takes that dtype too."""
    checkpoint = save_checkpoint("llama", tmp_path / "llama", CHAT_TEMPLATE)
    script = SCRIPT.replace('device="cuda",', f'device="cuda", dtype="{dtype}",')
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "triton"), str(checkpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["begun"] and len(got["early"]) >= 6, got["early"]  # norm, rotary, act, gemv, KV write, decode
    assert got["after"] == got["early"]  # the load's compile-ahead and the stages compiled nothing more
    assert len(got["tokens"]) == 6
