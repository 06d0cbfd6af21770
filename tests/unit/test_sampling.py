"""The batched sampler, its parameters and the stop checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.engine.sampling.sampler import Sampler, SamplingParams, make_generator, stop_reason, trim_stop_text

CPU = torch.device("cpu")


def _sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    gens = [make_generator(p.seed, CPU) for p in params]
    return Sampler(CPU).sample(logits, params, gens)


def _logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n draws for one row, batched as n identical rows sharing one seeded generator."""
    gen = make_generator(params.seed, CPU)
    rows = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return Sampler(CPU).sample(rows, [params] * n, [gen] * n)


def _entropy(tokens: torch.Tensor, vocab: int) -> float:
    freq = torch.bincount(tokens, minlength=vocab).double() / len(tokens)
    nz = freq[freq > 0]
    return float(-(nz * nz.log()).sum())


def test_greedy_is_argmax():
    logits = _logits()
    tokens = _sample(logits, [SamplingParams()] * logits.shape[0])
    assert tokens.dtype == torch.long
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1, seed=3),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=3),
        SamplingParams(temperature=2.0, top_k=1),
    ],
)
def test_filters_that_leave_one_token_are_greedy(params):
    logits = _logits(rows=8)
    assert torch.equal(_sample(logits, [params] * 8), logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = _logits(rows=4)
    hot = SamplingParams(temperature=5.0, seed=1)
    params = [SamplingParams(), hot, SamplingParams(), hot]
    tokens = _sample(logits, params)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


@pytest.mark.parametrize("first", ["greedy", "sampled"])
def test_mixed_batch_samples_its_sampled_rows(first):
    """Greedy and sampled rows over the same nearly flat logits: the greedy rows all take the
    argmax, the sampled ones spread over the vocabulary as a draw does."""
    row = _logits(rows=1, vocab=50)[0] / 30
    greedy, hot = SamplingParams(), SamplingParams(temperature=1.0)
    params = [greedy, hot] * 200 if first == "greedy" else [hot, greedy] * 200
    tokens = _sample(row.expand(400, -1).contiguous(), params)
    is_greedy = torch.tensor([p.greedy for p in params])
    assert torch.all(tokens[is_greedy] == row.argmax())
    drawn = tokens[~is_greedy]
    assert len(set(drawn.tolist())) > 25 and float((drawn == row.argmax()).double().mean()) < 0.2


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-45, 1e-38, 1e-8])
def test_a_top_p_that_rounds_to_nothing_keeps_the_most_likely_token(top_p):
    logits = _logits(rows=8)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=i) for i in range(8)]
    assert torch.equal(_sample(logits, params), logits.argmax(dim=-1))
    assert torch.equal(_sample(logits.to(torch.bfloat16), params), logits.to(torch.bfloat16).argmax(dim=-1))


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.one_of(st.just(0.0), st.floats(1e-45, 20.0)),
    top_k=st.integers(0, 60),
    top_p=st.one_of(st.floats(5e-324, 1.0, exclude_min=False), st.just(1.0)),
    masked=st.integers(0, 49),
    seed=st.integers(0, 2**32),
)
def test_no_filter_leaves_a_row_without_a_candidate(temperature, top_k, top_p, masked, seed):
    """Whatever the parameters, the token drawn is one the model allows (finite logit), and a
    filter that keeps a single token keeps the most likely one."""
    logits = _logits(rows=1, vocab=50, seed=seed % 1000)[0]
    logits[torch.randperm(50, generator=torch.Generator().manual_seed(seed))[:masked]] = float("-inf")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    token = int(_sample(logits.unsqueeze(0), [params])[0])
    assert math.isfinite(float(logits[token]))
    if top_k == 1 or top_p < 1e-30:
        assert token == int(logits.argmax())


def test_same_seed_same_tokens_whatever_the_batch():
    logits = _logits(rows=1, vocab=200)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [int(_sample(logits, [seeded])[0]) for _ in range(3)]
    other = SamplingParams(temperature=1.0)
    batch = torch.cat([_logits(rows=2, vocab=200, seed=9), logits])
    in_batch = int(_sample(batch, [other, other, seeded])[2])
    assert alone == [alone[0]] * 3 and in_batch == alone[0]


def test_a_seeded_generator_gives_a_reproducible_stream():
    logits = _logits(rows=1, vocab=500)
    params = SamplingParams(temperature=1.0, seed=7)

    def stream():
        gen, sampler = make_generator(7, CPU), Sampler(CPU)
        return [int(sampler.sample(logits, [params], [gen])[0]) for _ in range(20)]

    first = stream()
    assert first == stream()
    assert len(set(first)) > 1  # the generator advances: not the same token every step


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    a = _draws(logits[0], SamplingParams(temperature=1.0, seed=1), 50)
    b = _draws(logits[0], SamplingParams(temperature=1.0, seed=2), 50)
    assert not torch.equal(a, b)


def test_draws_follow_the_softmax_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    tokens = _draws(logits, SamplingParams(temperature=1.0, seed=0), 20000)
    freq = torch.bincount(tokens, minlength=4).double() / len(tokens)
    expected = torch.softmax(logits.double(), dim=-1)
    assert torch.allclose(freq, expected, atol=0.015)


def test_higher_temperature_raises_entropy():
    logits = _logits(rows=1, vocab=30)[0]
    entropies = [_entropy(_draws(logits, SamplingParams(temperature=t, seed=5), 4000), 30) for t in (0.3, 1.0, 3.0)]
    assert entropies[0] < entropies[1] < entropies[2]


def test_top_k_only_draws_from_the_k_best():
    logits = _logits(rows=1, vocab=100)[0]
    tokens = _draws(logits, SamplingParams(temperature=10.0, top_k=5, seed=1), 2000)
    allowed = set(logits.topk(5).indices.tolist())
    assert set(tokens.tolist()) == allowed  # high temperature: all five get drawn


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens = _draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.7, seed=2), 3000)
    assert set(tokens.tolist()) == {0, 1}
    freq0 = float((tokens == 0).double().mean())
    assert math.isclose(freq0, 0.5 / 0.8, abs_tol=0.03)  # renormalised over the kept set


def test_per_row_filters_in_one_batch():
    logits = _logits(rows=1, vocab=100)[0]
    rows = logits.unsqueeze(0).expand(400, -1).contiguous()
    params = [SamplingParams(temperature=10.0, top_k=1 + i % 2) for i in range(400)]
    tokens = _sample(rows, params)
    best2 = logits.topk(2).indices
    assert torch.all(tokens[0::2] == best2[0])
    assert set(tokens[1::2].tolist()) == set(best2.tolist())


def test_batch_size_mismatch_is_rejected():
    with pytest.raises(ValueError, match="one SamplingParams and one generator per logits row"):
        _sample(_logits(rows=3), [SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        Sampler(CPU).sample(torch.zeros(5), [SamplingParams()], [None])


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("max_tokens", 0, r"in \[1, 9223372036854775807\]"),
        ("max_tokens", 2.5, r"in \[1, "),
        ("max_tokens", 2**63, r"in \[1, 9223372036854775807\]"),  # past what the engine channel's frames carry
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("top_k", -1, r"in \[0, 9223372036854775807\]"),
        ("top_k", 10**30, r"in \[0, 9223372036854775807\]"),
        ("top_p", 0.0, r"\(0, 1\]"),
        ("top_p", 1.5, r"\(0, 1\]"),
        ("seed", -1, "None or an integer"),
        ("stop_token_ids", (1, -2), r"integers in \[0, "),
        ("stop_token_ids", (2**64,), r"integers in \[0, 9223372036854775807\]"),
        ("stop", ("",), "non-empty strings"),
        ("ignore_eos", "yes", "a bool"),
    ],
)
def test_validation_names_the_field_and_range(field, value, allowed):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*{allowed}"):
        SamplingParams(**{field: value})


def test_lists_become_tuples_and_params_are_frozen():
    params = SamplingParams(stop_token_ids=[3, 4], stop=["\n\n"])
    assert params.stop_token_ids == (3, 4) and params.stop == ("\n\n",)
    with pytest.raises(AttributeError):
        params.max_tokens = 3  # type: ignore[misc]


def test_make_generator():
    assert make_generator(None, CPU) is None
    a, b = make_generator(11, CPU), make_generator(11, CPU)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_stop_reason():
    params = SamplingParams(max_tokens=3, stop_token_ids=(7,), stop=("END",))
    eos = {2}
    assert stop_reason([5], "a", params, eos) is None
    assert stop_reason([5, 7], "ab", params, eos) == "stop"
    assert stop_reason([5, 2], "ab", params, eos) == "stop"
    assert stop_reason([5, 6], "xEND", params, eos) == "stop"
    assert stop_reason([5, 6, 8], "abc", params, eos) == "length"
    assert stop_reason([5, 6, 7], "abc", params, eos) == "stop"  # stop wins over length


def test_ignore_eos_keeps_going_until_length():
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    assert stop_reason([2], "", params, {2}) is None
    assert stop_reason([2, 2], "", params, {2}) == "length"


def test_trim_stop_text_cuts_at_the_earliest_stop():
    params = SamplingParams(stop=("B", "A"))
    assert trim_stop_text("xxAyyBzz", params) == "xx"
    assert trim_stop_text("plain", params) == "plain"


def test_a_plain_string_stop_is_one_stop_string_not_its_characters():
    params = SamplingParams(stop="\n\n")
    assert params.stop == ("\n\n",)
    assert stop_reason([5], "line one\nline two", params, set()) is None


@pytest.mark.parametrize(("field", "value"), [("stop_token_ids", 5), ("stop", 3)])
def test_a_non_sequence_for_a_tuple_field_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("temperature", [1e-30, 1e-39, 1e-45])
def test_a_tiny_temperature_is_effectively_greedy_not_token_zero(temperature):
    logits = _logits(rows=4)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(4)]
    assert torch.equal(_sample(logits, params), logits.argmax(dim=-1))
