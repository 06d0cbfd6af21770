"""How many runs the paged decode kernel splits each row's blocks in (``triton_decode.num_splits``):
a decided count from the grid and the table's width alone, so a CUDA graph keeps it at replay.
The kernel itself, split and merged, is checked against direct attention in
tests/integration/test_triton_decode.py (Triton's interpreter) and tests/gpu (compiled)."""

from __future__ import annotations

import pytest

from bootstrap.engine.kernels.paged_kv import MAX_SPLITS, MIN_SPLIT_BLOCKS, num_splits

WANTED = 528  # four programs per multiprocessor of an H200


@pytest.mark.parametrize(
    ("programs", "width", "splits"),
    [
        (8, 256, MAX_SPLITS),  # batch 1 of an 8B model (8 KV heads), a wide table: capped
        (40, 256, 13),  # its verify pass at k = 4: five rows
        (64, 256, 8),  # batch 8
        (256, 256, 2),  # batch 32
        (512, 256, 1),  # batch 64: the grid fills the device by itself, no merge kernel
        (4096, 256, 1),
        (8, MIN_SPLIT_BLOCKS * 2 - 1, 1),  # runs would be shorter than MIN_SPLIT_BLOCKS columns
        (8, MIN_SPLIT_BLOCKS * 3, 3),
        (8, 1, 1),
    ],
)
def test_splits_fill_the_device_without_short_runs(programs, width, splits):
    assert num_splits(programs, width, WANTED) == splits


def test_splits_never_leave_a_row_unsplittable_or_overfull():
    for programs in range(1, 600, 7):
        for width in range(1, 300, 13):
            got = num_splits(programs, width, WANTED)
            assert 1 <= got <= MAX_SPLITS
            assert got == 1 or (width // got >= MIN_SPLIT_BLOCKS and programs * got <= WANTED)
