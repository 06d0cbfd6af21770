"""The few-row linear kernel's tile (``gemv.choose``): decided from the shape and the device's
multiprocessors alone, so a CUDA graph keeps it at replay. The kernel itself is checked against
float64 in tests/integration/test_gemv.py (Triton's interpreter) and tests/gpu (compiled)."""

from __future__ import annotations

import pytest

from bootstrap.engine.layers.gemv import MAX_ROWS, MAX_SPLIT, choose

SMS = 132  # an H200


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 4096), (40, 96)])
def test_a_tile_fills_the_device_without_short_runs(rows, n, k):
    tile = choose(rows, n, k, SMS)
    assert tile.dot == (rows > 2)  # tensor cores from three rows: per-thread sums would need 3x the registers
    programs = -(-n // tile.block_n)
    assert 1 <= tile.split <= MAX_SPLIT
    if tile.split > 1:  # split only while the columns alone leave the device short, never in runs under 4 steps
        assert programs * (tile.split - 1) < 4 * SMS and k >= 4 * tile.block_k * tile.split


def test_the_tile_depends_on_the_row_class_only():
    assert {choose(rows, 2048, 8192, SMS) for rows in (1, 2)} == {choose(1, 2048, 8192, SMS)}
    assert {choose(rows, 2048, 8192, SMS) for rows in range(3, MAX_ROWS + 1)} == {choose(3, 2048, 8192, SMS)}
