"""The one-row linear kernel (``bootstrap.engine.kernels.gemv``) against a float64 product, in
Triton's CPU interpreter (a subprocess with ``TRITON_INTERPRET=1``); skipped where Triton is not
installed (CPU builds of torch come without it). On CUDA, tests/gpu runs the compiled kernel in
half precision, inside CUDA graphs, against cuBLAS."""

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
    import torch
    from bootstrap.engine.kernels.gemv import linear

    torch.manual_seed(0)
    cases = [  # out and in features (neither a multiple of the tile), tile, bias
        (40, 300, (4, 128), False),
        (33, 520, (8, 64), True),  # several steps, the last one short
        (17, 2100, (4, 1024), True),  # the default tile: two full steps and a short one
        (3, 64, (4, 1024), False),  # fewer rows than one program holds
    ]
    for n, k, tile, bias in cases:
        x, w = torch.randn(1, k), torch.randn(n, k)
        b = torch.randn(n) if bias else None
        expected = x.double() @ w.double().T + (b.double() if bias else 0)
        got = linear(x, w, b, *tile)
        assert got.shape == (1, n) and got.dtype == x.dtype, (tile, got.shape)
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5, msg=str(tile))
    strided, w = torch.randn(1, 2 * 64)[:, ::2], torch.randn(24, 64)  # an input that is not contiguous: copied first
    torch.testing.assert_close(linear(strided, w, None, 8, 32).double(), strided.double() @ w.double().T, atol=1e-4,
                               rtol=1e-5)
    print("ok")
""")


def test_the_kernel_matches_a_float64_product():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
