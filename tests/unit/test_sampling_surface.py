"""The rest of the OpenAI sampling surface in the batched sampler: penalties, min_p,
min_tokens, logprobs and their validation, each against a plain reference written here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.engine.sampling import sampler as sampling
from bootstrap.engine.sampling.processing import History, process, token_logprobs
from bootstrap.engine.sampling.sampler import Sampler, SamplingParams, make_generator, stop_reason

CPU = torch.device("cpu")
VOCAB = 12
EOS = 2


def _reference_penalties(row: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """HF/vLLM repetition over prompt + output, then OpenAI presence/frequency over output."""
    row = list(row)
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    return row


penalty = st.floats(-2, 2, allow_nan=False)
history = st.lists(st.integers(0, VOCAB - 1), max_size=8)
row_case = st.tuples(history, history, penalty, penalty, st.sampled_from([1.0, 0.5, 1.3, 2.0]), st.integers(0, 2**31))


@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.lists(row_case, min_size=1, max_size=5))
def test_penalties_match_the_reference_and_decide_the_greedy_token(rows):
    logits, params, histories, want = [], [], [], []
    for prompt, output, presence, frequency, repetition, seed in rows:
        row = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3).tolist()
        p = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
        prompt = prompt or [0]  # the engine never has an empty prompt
        logits.append(row)
        params.append(p)
        histories.append(History(prompt + output, len(prompt)))
        want.append(_reference_penalties(row, prompt, output, p))
    got = process(torch.tensor(logits), params, histories, {EOS})
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)
    tokens = Sampler(CPU).sample(torch.tensor(logits), params, [None] * len(rows), histories)
    assert tokens.tolist() == torch.tensor(want).argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params, prompt, output",
    [
        (SamplingParams(frequency_penalty=0.6), [9], [0, 0]),  # 5 - 1.2 < 4
        (SamplingParams(presence_penalty=1.5), [9], [0]),  # 5 - 1.5 < 4
        (SamplingParams(repetition_penalty=2.0), [0], []),  # the prompt counts for repetition: 2.5 < 4
        (SamplingParams(repetition_penalty=1.5, temperature=1e-6, seed=1), [0], [3]),  # a sampled row too
    ],
)
def test_a_penalty_changes_the_argmax(params, prompt, output):
    logits = torch.tensor([[5.0, 4.0, -1.0, 0.5]])
    gens = [make_generator(params.seed, CPU)]
    assert Sampler(CPU).sample(logits, [SamplingParams()], [None]).tolist() == [0]
    assert Sampler(CPU).sample(logits, [params], gens, [History(prompt + output, len(prompt))]).tolist() == [1]


def test_a_tiny_repetition_penalty_with_a_temperature_samples_among_the_seen_tokens():
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])  # 2.0 / 1e-39 overflows float32
    tokens = set()
    for seed in range(32):
        p = SamplingParams(repetition_penalty=1e-39, temperature=1.0, seed=seed)
        tokens.add(Sampler(CPU).sample(logits, [p], [make_generator(seed, CPU)], [History([1, 2], 2)]).item())
    assert tokens == {1, 2}  # both seen positive logits are pushed to the top; a NaN row would give 0


def test_presence_and_frequency_ignore_the_prompt_and_repetition_multiplies_negatives():
    logits = torch.tensor([[5.0, 4.0, -1.0, 0.5]])
    history = [History([0, 2], 2)]
    assert torch.equal(
        process(logits, [SamplingParams(frequency_penalty=2.0, presence_penalty=2.0)], history, set()), logits
    )
    got = process(logits, [SamplingParams(repetition_penalty=2.0)], history, set())
    assert got.tolist() == [[2.5, 4.0, -2.0, 0.5]]


def test_rows_without_the_features_skip_processing(monkeypatch):
    def boom(*args):
        raise AssertionError("processed a batch that needs nothing")

    monkeypatch.setattr(sampling, "process", boom)
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=0.8, min_p=0.1), SamplingParams(min_tokens=2)]
    histories = [History([1], 1), History([1], 1), History([1, 4, 5], 1)]  # min_tokens already met
    tokens = Sampler(CPU).sample(logits, params, [None] * 3, histories)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    Sampler(CPU).sample(logits, [SamplingParams()] * 3, [None] * 3)  # no histories at all: the old call


def test_penalties_without_histories_are_refused():
    with pytest.raises(ValueError, match="one History per logits row"):
        Sampler(CPU).sample(torch.zeros(1, VOCAB), [SamplingParams(presence_penalty=1.0)], [None])


def test_a_mixed_batch_penalizes_only_its_penalized_rows():
    logits = torch.tensor([[5.0, 4.0, 0.0]] * 2)
    params = [SamplingParams(frequency_penalty=2.0), SamplingParams()]
    histories = [History([0, 0], 1), History([0, 0], 1)]
    assert Sampler(CPU).sample(logits, params, [None, None], histories).tolist() == [1, 0]


# ---- min_p ----------------------------------------------------------------------------------


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.floats(0.01, 1.0), st.sampled_from([0.5, 1.0, 2.0]))
def test_min_p_keeps_exactly_the_tokens_at_or_above_the_threshold(seed, min_p, temperature):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    probs = torch.softmax(logits / temperature, dim=-1)
    keep = probs >= min_p * probs.max()
    shifted = ((logits - logits.max()) / temperature).unsqueeze(0)
    kept = Sampler(CPU)._min_p(shifted, [SamplingParams(temperature=temperature, min_p=min_p)]) > float("-inf")
    # the boundary itself is a float rounding question: compare away from it
    clear = (probs - min_p * probs.max()).abs() > 1e-6
    assert torch.equal(kept[0][clear], keep[clear]) and kept[0, logits.argmax()]


def test_min_p_draws_only_from_the_kept_tokens():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    params = SamplingParams(temperature=1.0, min_p=0.2, seed=5)  # threshold 0.08: tokens 0, 1, 2
    n = 3000
    rows = probs.log().unsqueeze(0).expand(n, -1).contiguous()
    gen = make_generator(params.seed, CPU)
    drawn = Sampler(CPU).sample(rows, [params] * n, [gen] * n)
    assert set(drawn.tolist()) == {0, 1, 2}
    one = SamplingParams(temperature=5.0, min_p=1.0, seed=1)  # only the top token is left
    assert set(Sampler(CPU).sample(rows, [one] * n, [make_generator(1, CPU)] * n).tolist()) == {0}


# ---- min_tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_eos_and_stop_ids_back(temperature):
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 7], logits[0, 3] = 60.0, 50.0, 1.0
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=(7,), max_tokens=5, seed=0)
    sampler = Sampler(CPU)
    for generated in range(3):
        history = [History([1] + [4] * generated, 1)]
        for _ in range(20):
            token = sampler.sample(logits, [params], [make_generator(params.seed, CPU)], history, {EOS}).item()
            assert token not in (EOS, 7)
    assert sampler.sample(logits, [params], [None], [History([1, 4, 4, 4], 1)], {EOS}).item() == EOS


def test_min_tokens_with_ignore_eos_holds_back_only_the_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 7] = 60.0, 70.0
    params = SamplingParams(min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    assert Sampler(CPU).sample(logits, [params], [None], [History([1], 1)], {EOS}).item() == EOS


def test_stop_reason_waits_for_min_tokens():
    params = SamplingParams(min_tokens=3, max_tokens=5, stop_token_ids=(7,), stop=("x",))
    assert stop_reason([EOS], "", params, {EOS}) is None
    assert stop_reason([4, 7], "x", params, {EOS}) is None
    assert stop_reason([4, 4, 7], "", params, {EOS}) == "stop"
    assert stop_reason([4, 4, EOS], "", params, {EOS}) == "stop"
    assert stop_reason([4, 4, 4], "axb", params, {EOS}) == "stop"
    assert stop_reason([4, 4, 4, 4, 4], "", params, {EOS}) == "length"


# ---- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_the_raw_distribution_for_the_rows_that_ask():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        SamplingParams(logprobs=4, temperature=0.5, frequency_penalty=2.0, seed=2),
        SamplingParams(),
        SamplingParams(logprobs=0),
    ]
    histories = [History([1, int(logits[0].argmax())], 1), History([1], 1), History([1], 1)]
    gens = [make_generator(2, CPU), None, None]
    out = Sampler(CPU).sample_with_logprobs(logits, params, gens, histories, {EOS})
    want = torch.log_softmax(logits, dim=-1)
    first, second, third = out.logprobs
    assert second is None and third is not None and third.top == ()
    assert first.token_id == out.tokens[0].item()
    assert first.logprob == pytest.approx(want[0, first.token_id].item(), abs=1e-6)
    values, ids = want[0].topk(4)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert third.logprob == pytest.approx(want[2].max().item(), abs=1e-6)


def test_top_logprobs_are_capped_by_the_vocabulary():
    [entry] = token_logprobs(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([2]), [SamplingParams(logprobs=20)])
    assert [t for t, _ in entry.top] == [2, 1, 0]


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_p": -0.1}, r"SamplingParams\.min_p must be a number in \[0, 1\]"),
        ({"min_p": 1.5}, r"SamplingParams\.min_p must be a number in \[0, 1\]"),
        ({"min_p": float("nan")}, r"SamplingParams\.min_p must be"),
        ({"presence_penalty": 2.5}, r"SamplingParams\.presence_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"SamplingParams\.frequency_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": True}, r"SamplingParams\.frequency_penalty must be"),
        ({"repetition_penalty": 0}, r"SamplingParams\.repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, r"SamplingParams\.repetition_penalty must be a finite number > 0"),
        ({"min_tokens": -1}, r"SamplingParams\.min_tokens must be an integer in \[0, max_tokens=16\]"),
        ({"min_tokens": 5, "max_tokens": 4}, r"SamplingParams\.min_tokens must be an integer in \[0, max_tokens=4\]"),
        ({"min_tokens": 1.0}, r"SamplingParams\.min_tokens must be an integer"),
        ({"logprobs": 21}, r"SamplingParams\.logprobs must be None or an integer in \[0, 20\]"),
        ({"logprobs": -1}, r"SamplingParams\.logprobs must be None or an integer in \[0, 20\]"),
        ({"logprobs": True}, r"SamplingParams\.logprobs must be None or an integer"),
    ],
)
def test_validation_names_the_field_and_the_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_the_edges_of_each_range_are_accepted():
    SamplingParams(
        min_p=0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01, min_tokens=16, logprobs=20
    )
    SamplingParams(min_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0, repetition_penalty=10.0, logprobs=0)
