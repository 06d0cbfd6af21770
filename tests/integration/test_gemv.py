"""The few-row linear kernel (``bootstrap.engine.layers.gemv``) against a float64 product, in
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

SCRIPT = textwrap.dedent('''
    import torch
    from bootstrap.engine.layers.gemv import Tile, choose, linear

    torch.manual_seed(0)
    cases = [  # rows, out and in features (neither a multiple of the tile), tile, bias
        (1, 40, 300, Tile(8, 128, 1), False),
        (2, 33, 520, Tile(16, 128, 3), True),  # three runs, the last one short: the reduce kernel
        (1, 17, 1000, Tile(8, 256, 4), True),
        (3, 40, 300, Tile(16, 64, 1, dot=True), True),
        (8, 33, 520, Tile(32, 128, 3, dot=True), False),
        (5, 70, 96, Tile(32, 64, 2, dot=True), True),  # a run with no step of its own
        (4, 24, 64, choose(4, 24, 64, 132), True),
    ]
    for rows, n, k, tile, bias in cases:
        x, w = torch.randn(rows, k), torch.randn(n, k)
        b = torch.randn(n) if bias else None
        expected = x.double() @ w.double().T + (b.double() if bias else 0)
        got = linear(x, w, b, tile=tile)
        assert got.shape == (rows, n) and got.dtype == x.dtype, (tile, got.shape)
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5, msg=str(tile))
    strided = torch.randn(3, 2 * 64)[:, ::2]  # rows whose inputs are not contiguous: copied first
    w = torch.randn(24, 64)
    torch.testing.assert_close(linear(strided, w).double(), strided.double() @ w.double().T, atol=1e-4, rtol=1e-5)
    print("ok")
''')


def test_the_kernel_matches_a_float64_product_for_each_tile_kind():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
