"""Prefix caching on a CUDA device, through the stages (graphs captured): requests that share a
long prompt prefix, one after another and then all at once, answer as with the cache off, the
later ones starting after the cached blocks; nothing is held once they are done."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from helpers.tiny_models import save_checkpoint  # noqa: E402

from bootstrap.api import Bootstrap  # noqa: E402
from bootstrap.config import BootstrapConfig  # noqa: E402
from bootstrap.engine.sampling.sampler import SamplingParams  # noqa: E402

PREFIX = [(11 * i + 5) % 240 + 3 for i in range(100)]  # 3 full blocks of 32 and 4 tokens
TAILS = [[17, 29, 31], [101, 7], [44, 45, 46, 47, 48], [9]]
BOUND_S = 120.0


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


async def answers(path: Path, caching: bool) -> tuple[list, list, dict]:
    shape = dict(max_seq_len=256, max_num_tokens=256, max_batch_size=8, max_kv_bytes=1 << 30)
    config = BootstrapConfig(model=str(path), device="cuda", dtype="float32", prefix_caching=caching, **shape)
    boot = Bootstrap(config)
    try:
        executor = await boot.build()
        assert executor.runner.graphs is not None
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        one_by_one = [executor.await_response(executor.enqueue(PREFIX + t, params), BOUND_S) for t in TAILS]
        ids = [executor.enqueue(PREFIX + t + [3], params) for t in TAILS]
        together = [executor.await_response(i, BOUND_S) for i in ids]
        stats = executor.engine_stats()
        return one_by_one, together, {"used": stats.kv_used_blocks, "cached": stats.kv_cached_blocks}
    finally:
        await boot.aclose()


def test_cached_prefixes_answer_as_without_the_cache_on_cuda(llama):
    on_one, on_all, on_kv = anyio.run(answers, llama, True)
    off_one, off_all, _ = anyio.run(answers, llama, False)
    assert [r.token_ids for r in on_one] == [r.token_ids for r in off_one]
    assert [r.token_ids for r in on_all] == [r.token_ids for r in off_all]
    assert [r.cached_tokens for r in on_one] == [0, 96, 96, 96]
    assert all(r.cached_tokens == 96 for r in on_all)  # the prefix was cached before they came
    assert on_kv["used"] == 0 and on_kv["cached"] > 0
