"""The few-row linear kernel (``bootstrap.engine.layers.gemv``) compiled on CUDA: against a
float64 product, no further from it than cuBLAS is, for each row count it takes and the
projection shapes of real models; inside a CUDA graph, replaying new inputs; and the layers'
``project`` taking it exactly where ``usable`` says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bootstrap.engine.layers import gemv
from bootstrap.engine.layers.linear import project

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or gemv.triton is None, reason="needs CUDA and Triton")
CUDA = torch.device("cuda")
SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (4096, 14336), (32000, 2048), (40, 96)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", range(1, gemv.MAX_ROWS + 1))
def test_the_kernel_is_as_close_to_float64_as_cublas(dtype, n, k, rows):
    torch.manual_seed(n + k + rows)
    x = torch.randn(rows, k, device=CUDA, dtype=dtype)
    w = (torch.randn(n, k, device=CUDA) / k**0.5).to(dtype)
    bias = torch.randn(n, device=CUDA, dtype=dtype) if rows % 2 else None
    expected = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    got, cublas = gemv.linear(x, w, bias), F.linear(x, w, bias)
    assert got.shape == (rows, n) and got.dtype == dtype
    ulp = torch.finfo(dtype).eps * expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= 1.5 * (cublas.double() - expected).abs().max().item() + ulp


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_captured_product_replays_new_inputs(rows):
    torch.manual_seed(rows)
    w = torch.randn(2048, 8192, device=CUDA, dtype=torch.bfloat16) / 90
    x = torch.randn(rows, 8192, device=CUDA, dtype=torch.bfloat16)
    assert gemv.usable(x, w) and gemv.choose(rows, 2048, 8192, gemv.streaming_multiprocessors(CUDA)).split > 1
    project(x, w)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = project(x, w)
    for seed in range(3):
        x.copy_(torch.randn(rows, 8192, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        assert torch.equal(out, gemv.linear(x, w))  # the same kernel, the same order: equal bits


def test_project_takes_the_kernel_only_where_usable_says():
    w = torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16)
    few, many = torch.randn(gemv.MAX_ROWS, 128, device=CUDA, dtype=torch.bfloat16), torch.randn(9, 128, device=CUDA)
    assert gemv.usable(few, w)
    assert not gemv.usable(many.bfloat16(), w)  # more rows than MAX_ROWS: cuBLAS
    assert not gemv.usable(few.float(), w.float())  # float32: cuBLAS (the kernel is for half precision)
    assert not gemv.usable(few.cpu(), w.cpu())
    assert not gemv.usable(few, w.t().contiguous().t())  # a weight whose rows are not contiguous
    torch.testing.assert_close(project(many, w.float()), F.linear(many, w.float()))
