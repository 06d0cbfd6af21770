"""The two-stage argmax on CUDA gives ``torch.argmax``'s answer (ties across pieces, NaN, many
rows past the split's range), also replayed inside a CUDA graph on new logits."""

from __future__ import annotations

import pytest
import torch

from bootstrap.engine.sampling.argmax import argmax, chunks_for, split

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("vocab", [128256, 151936, 49152, 32000])
@pytest.mark.parametrize("rows", [1, 5, 33, 65])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_stages_equal_torch_on_ties_and_nan(vocab, rows, dtype):
    torch.manual_seed(rows)
    x = torch.randn(rows, vocab, device=CUDA).to(dtype).round()  # few distinct values: ties in every row
    x[0, vocab - 1] = x[0].max() + 1  # the last index alone
    if rows > 2:
        x[2, vocab // 2], x[2, 7] = float("nan"), float("nan")
    want = x.argmax(dim=-1)
    assert torch.equal(argmax(x), want)  # split or not, as ``split`` picks
    assert torch.equal(argmax(x, chunks_for(vocab)), want)  # split at every vocabulary and row count
    assert torch.equal(argmax(x.view(rows, 1, vocab), chunks_for(vocab)), want[:, None])


def test_inside_a_graph_it_follows_new_logits():
    x = torch.randn(5, 128256, device=CUDA, dtype=torch.bfloat16)
    argmax(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax(x)
    assert split(128256, 5) > 1  # the split path is the one captured
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x).round())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x.argmax(dim=-1))
