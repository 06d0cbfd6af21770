"""The two-stage argmax gives exactly ``torch.argmax(dim=-1)``: first maximal index, NaN the
largest, for any split of the vocabulary it takes (here split as asked: on its own it splits on
CUDA only, where tests/gpu checks the same)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.engine.sampling.argmax import FEW_ROWS, MIN_PIECE, argmax, chunks_for, split


@st.composite
def logits(draw):
    """Rows of a vocabulary that splits, with few distinct values (many ties), maybe inf and NaN."""
    vocab = draw(st.sampled_from([256, 384, 1000, 2048, 128 * 7]))
    shape = draw(st.sampled_from([(vocab,), (1, vocab), (3, vocab), (2, 5, vocab)]))
    values = torch.tensor(draw(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 2.0]), min_size=4, max_size=4)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = values[torch.randint(0, 4, shape, generator=g)]
    for special in draw(st.lists(st.sampled_from([float("inf"), float("-inf"), float("nan")]), max_size=3)):
        x.view(-1, vocab)[:, int(torch.randint(0, vocab, (1,), generator=g))] = special
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    return x.to(dtype)


@settings(max_examples=300, deadline=None)
@given(logits(), st.sampled_from([None, 2, 4, 8]))
def test_two_stages_give_torchs_argmax(x, chunks):
    got = argmax(x, chunks)
    assert got.dtype == torch.long and got.shape == x.shape[:-1]
    assert torch.equal(got, x.argmax(dim=-1))


def test_the_first_of_two_maxima_in_different_pieces_wins():
    x = torch.zeros(2, 128256, dtype=torch.bfloat16)
    x[0, 100_000], x[0, 300] = 5, 5  # the later piece's maximum first, then an earlier one
    x[1, 128255] = 1
    assert argmax(x, split(128256, 2)).tolist() == [300, 128255]


def test_chunk_counts_divide_the_vocabulary_into_pieces_of_at_least_the_minimum():
    for vocab in (128256, 151936, 49152, 32000, 256000, 152064, 50257):
        chunks = chunks_for(vocab)
        assert vocab % chunks == 0 and (chunks == 1 or vocab // chunks >= MIN_PIECE)
    assert chunks_for(257) == 1 and chunks_for(5) == 1  # no split: torch.argmax itself


def test_a_chunk_count_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"chunks must divide the last dimension \(1000\), got 3"):
        argmax(torch.zeros(1000), 3)


def test_only_few_rows_of_the_vocabularies_torch_reduces_in_one_block_are_split():
    assert split(128256, 1) == chunks_for(128256) == 501 and split(65536, FEW_ROWS) == 512
    assert split(128256, FEW_ROWS + 1) == 1  # many rows fill the device by themselves
    assert split(151936, 1) == split(256000, 1) == split(32000, 1) == 1  # torch is as fast or faster there
