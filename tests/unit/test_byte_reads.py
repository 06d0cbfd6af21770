"""Checkpoint bytes read by threads straight into tensors (``engine.models.byte_reads``), and the
loader's plan of which tensor goes where (``engine.models.weights``), on real files."""

from __future__ import annotations

import json
import struct
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from bootstrap.engine.models.byte_reads import ByteRange, read_ranges
from bootstrap.engine.models.weights import _contiguous_start, stored_tensors


def reader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("bootstrap-weights")]


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
    piece=st.integers(1, 3000),
    threads=st.integers(1, 6),
    data=st.data(),
)
def test_every_range_lands_byte_for_byte_whatever_the_pieces_and_threads(tmp_path_factory, sizes, piece, threads, data):
    file = tmp_path_factory.mktemp("bytes") / "blob"
    blob = torch.randint(0, 256, (sum(sizes) + 100,), dtype=torch.uint8)
    file.write_bytes(blob.numpy().tobytes())
    offsets = [data.draw(st.integers(0, blob.numel() - n)) for n in sizes]
    targets = [torch.full((n,), 7, dtype=torch.uint8) for n in sizes]
    read_ranges([ByteRange(file, o, t) for o, t in zip(offsets, targets)], threads=threads, piece_bytes=piece)
    for offset, target in zip(offsets, targets):
        assert torch.equal(target, blob[offset : offset + target.numel()])
    assert reader_threads() == []


def test_a_wider_dtype_is_filled_by_its_bytes(tmp_path):
    values = torch.randn(33, 17)
    file = tmp_path / "f"
    file.write_bytes(b"xyz" + values.numpy().tobytes())
    target = torch.empty(33, 17)
    read_ranges([ByteRange(file, 3, target)], piece_bytes=100)
    assert torch.equal(target, values)


def test_a_file_shorter_than_its_ranges_is_an_error_naming_it_and_no_reader_is_left(tmp_path):
    file = tmp_path / "short.safetensors"
    file.write_bytes(bytes(1000))
    ranges = [
        ByteRange(file, 0, torch.empty(600, dtype=torch.uint8)),
        ByteRange(file, 600, torch.empty(800, dtype=torch.uint8)),
    ]
    with pytest.raises(ValueError, match=r"short\.safetensors: ends at byte 1000"):
        read_ranges(ranges, threads=2, piece_bytes=100)
    assert reader_threads() == []


@pytest.mark.parametrize(
    "index, shape, start",
    [
        ((), (4, 6), 0),
        ((slice(1, 3),), (4, 6), 6),  # rows: one run
        ((slice(None), slice(0, 3)), (4, 6), None),  # columns of several rows: not one run
        ((slice(None), slice(2, 5)), (1, 6), 2),  # columns of a single row: one run
        ((slice(0, 4, 2),), (4, 6), None),  # a step
        ((slice(2, 4),), (8,), 2),
        ((slice(None), slice(1, 2), slice(None)), (1, 3, 5), 5),
    ],
)
def test_a_slice_is_read_directly_only_when_it_is_one_run_of_bytes(index, shape, start):
    assert _contiguous_start(index, shape) == start
    if start is not None:  # the run is what indexing gives
        t = torch.arange(torch.Size(shape).numel()).view(shape)
        assert torch.equal(t[index].reshape(-1), t.reshape(-1)[start : start + t[index].numel()])


def test_the_header_gives_every_tensor_its_first_byte(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2).to(torch.bfloat16)}
    file = tmp_path / "model.safetensors"
    save_file(tensors, str(file), metadata={"format": "pt"})
    raw = file.read_bytes()
    for stored in stored_tensors(file):
        expected = tensors[stored.name]
        chunk = raw[stored.offset : stored.offset + expected.numel() * expected.element_size()]
        assert torch.equal(torch.frombuffer(bytearray(chunk), dtype=expected.dtype).view(expected.shape), expected)
        assert stored.shape == tuple(expected.shape)


SHORT = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()


@pytest.mark.parametrize(
    "content, match",
    [
        (b"\x01\x02", "not a safetensors file"),
        (struct.pack("<Q", 10**9) + b"{}", "not a safetensors file"),
        (struct.pack("<Q", 9) + b"not json!", "its header is not JSON"),
        (
            struct.pack("<Q", len(SHORT)) + SHORT + bytes(8),
            r"'data_offsets' \[0, 16\] must span",
        ),  # 8 bytes where 16 belong
    ],
)
def test_a_broken_header_is_an_error_naming_the_file(tmp_path, content, match):
    file = tmp_path / "broken.safetensors"
    file.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        stored_tensors(file)
