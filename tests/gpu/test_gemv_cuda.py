"""The one-row linear kernel (``bootstrap.engine.kernels.gemv``) compiled on CUDA: against a
float64 product, no further from it than cuBLAS is, for the projection shapes of real models;
inside a CUDA graph, replaying new inputs; and the layers' ``project`` taking it exactly where
``usable`` says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bootstrap.engine.kernels import gemv
from bootstrap.engine.layers.linear import project

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or gemv.triton is None, reason="needs CUDA and Triton")
CUDA = torch.device("cuda")
SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (4096, 14336), (32000, 2048), (40, 96), (7, 1000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_is_as_close_to_float64_as_cublas(dtype, n, k, bias):
    torch.manual_seed(n + k)
    x = torch.randn(1, k, device=CUDA, dtype=dtype)
    w = (torch.randn(n, k, device=CUDA) / k**0.5).to(dtype)
    b = torch.randn(n, device=CUDA, dtype=dtype) if bias else None
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    got, cublas = gemv.linear(x, w, b), F.linear(x, w, b)
    assert got.shape == (1, n) and got.dtype == dtype
    ulp = torch.finfo(dtype).eps * expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= 1.5 * (cublas.double() - expected).abs().max().item() + ulp


def test_a_captured_product_replays_new_inputs():
    torch.manual_seed(0)
    w = torch.randn(2048, 8192, device=CUDA, dtype=torch.bfloat16) / 90
    x = torch.randn(1, 8192, device=CUDA, dtype=torch.bfloat16)
    assert gemv.usable(x, w)
    project(x, w)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = project(x, w)
    for seed in range(3):
        x.copy_(torch.randn(1, 8192, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        assert torch.equal(out, gemv.linear(x, w))  # the same kernel, the same order: equal bits


def test_project_takes_the_kernel_only_where_usable_says():
    w = torch.randn(64, 128, device=CUDA, dtype=torch.bfloat16)
    one, two = torch.randn(1, 128, device=CUDA, dtype=torch.bfloat16), torch.randn(2, 128, device=CUDA)
    assert gemv.usable(one, w)
    assert not gemv.usable(two.bfloat16(), w)  # two rows: cuBLAS, which was as fast or faster there
    assert not gemv.usable(one.float(), w.float())  # float32: cuBLAS
    assert not gemv.usable(one.cpu(), w.cpu())
    assert not gemv.usable(one, w.t().contiguous().t())  # a weight whose rows are not contiguous
    torch.testing.assert_close(project(two, w.float()), F.linear(two, w.float()))
