"""The FP8 weight-only kernels (``bootstrap.engine.kernels.fp8_gemm``: ``one_row`` and
``few_rows``) against a float64 product of the dequantized weight, row and block scales, in
Triton's CPU interpreter (a subprocess with ``TRITON_INTERPRET=1``); skipped where Triton is not
installed (CPU builds of torch come without it). The interpreter rounds float32 to e4m3 unlike
the GPU, so the activation quantizer and the GEMM are tested on CUDA only
(tests/gpu/test_fp8_gemm_cuda.py); its ``tl.dot`` of bfloat16 is wrong, so ``few_rows`` takes
float16 rows here and bfloat16 ones there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

SCRIPT = textwrap.dedent("""
    import math
    import torch
    from bootstrap.engine.kernels.fp8_gemm import FP8, dequantize, one_row

    torch.manual_seed(0)
    cases = [  # out and in features (neither a multiple of the tile), scale blocks, bias
        (40, 300, None, False),
        (33, 520, None, True),
        (260, 1100, (128, 128), True),  # partial blocks at both ends
        (130, 300, (16, 64), False),
        (70, 200, (2, 32), True),  # row blocks shorter than the tile's rows
        (3, 64, None, False),
    ]
    for n, k, block, bias in cases:
        w = (torch.randn(n, k) * 100).clamp(-448, 448).to(FP8)
        shape = (math.ceil(n / block[0]), math.ceil(k / block[1])) if block else (n, 1)
        s = torch.rand(shape) + 0.5
        x, b = torch.randn(1, k), (torch.randn(n) if bias else None)
        expected = x.double() @ dequantize(w, s, block, torch.float64).T + (b.double() if bias else 0)
        for tile in [(None, None), (4, 1024), (8, 128), (16, 64)]:  # (None, None): ``tile``'s
            got = one_row(x, w, s, block, b, *tile)
            assert got.shape == (1, n) and got.dtype == x.dtype
            torch.testing.assert_close(got.double(), expected, atol=1e-3, rtol=1e-4, msg=str((n, k, block, tile)))
    print("ok")
""")

FEW_ROWS = textwrap.dedent("""
    import math
    import torch
    from bootstrap.engine.kernels.fp8_gemm import FP8, dequantize, few_rows

    torch.manual_seed(0)
    cases = [  # rows, out and in features (neither a multiple of the tile), scale blocks, bias
        (2, 40, 300, None, False),
        (16, 33, 520, None, True),
        (5, 260, 1100, (128, 128), True),  # partial blocks at both ends
        (40, 130, 300, (16, 64), False),  # row blocks shorter than the tile's rows
        (64, 70, 200, (32, 16), True),  # column blocks shorter than the tile's columns
    ]
    for rows, n, k, block, bias in cases:
        w = (torch.randn(n, k) * 100).clamp(-448, 448).to(FP8)
        shape = (math.ceil(n / block[0]), math.ceil(k / block[1])) if block else (n, 1)
        s = torch.rand(shape) + 0.5
        x, b = torch.randn(rows, k).half(), (torch.randn(n).half() if bias else None)
        expected = x.double() @ dequantize(w, s, block, torch.float64).T + (b.double() if bias else 0)
        for tile in [(None, None), (16, 256), (32, 128), (64, 64)]:  # (None, None): ``FEW_TILE``
            got = few_rows(x, w, s, block, b, *tile)
            assert got.shape == (rows, n) and got.dtype == x.dtype
            error = (got.double() - expected).abs().max().item()
            assert error <= torch.finfo(torch.float16).eps * expected.abs().max().item(), (rows, n, k, block, tile)
    print("ok")
""")


def interpret(script: str) -> None:
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_one_row_kernel_matches_a_float64_product_of_the_dequantized_weight():
    interpret(SCRIPT)


def test_the_few_rows_kernel_matches_a_float64_product_of_the_dequantized_weight():
    interpret(FEW_ROWS)
