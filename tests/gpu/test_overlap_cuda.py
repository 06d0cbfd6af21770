"""Overlap scheduling on CUDA, decode steps replayed from captured graphs: the same tokens,
finishes and logprobs as without it over ``helpers.overlap_workload`` (greedy, seeded, penalised,
``n`` choices, stops, prefix hits), in float32 and in bfloat16, and one wasted step a stop at most."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.overlap_workload import assert_same_outcome, frequent_tokens, run_workload
from helpers.tiny_llama import build_model

from bootstrap.engine import KVCacheSpec, PagedKVCache, SchedulerConfig, create_executor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def model():
    return build_model()


@pytest.fixture(scope="module")
def frequent(model) -> list[int]:
    return frequent_tokens(model)


def outcome(model, frequent, dtype: torch.dtype, overlap: bool) -> tuple[list, int]:
    target = copy.deepcopy(model).to("cuda", dtype)
    spec = KVCacheSpec.from_config(target.config, dtype)
    cache = PagedKVCache.from_tokens(spec, 2048, 16, "cuda")
    config = SchedulerConfig(6, 64, 128, True, overlap)
    ex = create_executor(target, cache, config, eos_token_ids={frequent[0]}, start=False)
    ex.runner.capture_decode_graphs([1, 2, 4, 6])  # up to the batch limit (6)
    return run_workload(ex, 1, frequent[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overlap_on_graphs_gives_the_outcome_of_the_plain_loop(model, frequent, dtype):
    plain, plain_forwards = outcome(model, frequent, dtype, False)
    overlapped, overlapped_forwards = outcome(model, frequent, dtype, True)
    assert_same_outcome(overlapped, plain, tolerance=1e-4 if dtype == torch.float32 else 2e-2)
    stops = sum(reason == "stop" for _, reason, _, _ in plain)
    assert plain_forwards <= overlapped_forwards <= plain_forwards + stops
