"""A seeded sampled request gives the same tokens whatever shares its batch, with a draft or without
(``bootstrap.engine.sampling.sampler.generator_at``, ``spec.verify.accept_matching``): alone, and
beside other sampled, greedy and seeded requests and a long prompt whose chunked prefill arrives
mid-stream (ordinary steps between speculative ones, depths capped by a request near its end). With
a draft it gets the tokens it gets without one, both with a draft that always agrees and one that
rarely does."""

from __future__ import annotations

from test_engine_speculation import PROMPTS, executor, model

from bootstrap.engine import SamplingParams

SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
LONG_PROMPT = [(5 * i + 1) % 250 + 3 for i in range(120)]  # 8 chunks of 16 tokens


def seeded_tokens(target, draft, crowded: bool) -> tuple[list[int], tuple[int, int]]:
    """The seeded request's tokens, and the draft's (proposed, accepted) counts."""
    ex = executor(target, draft)
    try:
        request = ex.enqueue(PROMPTS[1], SEEDED)
        others = []
        if crowded:
            others = [
                ex.enqueue(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.8)),
                ex.enqueue(PROMPTS[2], SamplingParams(max_tokens=6, temperature=0)),  # ends early: caps the depth
                ex.enqueue(PROMPTS[2], SamplingParams(max_tokens=30, temperature=1.2, seed=8)),
            ]
        tokens = []
        for event in ex.stream(request):
            if event.token_id is not None:
                tokens.append(event.token_id)
            if crowded and len(tokens) == 5 and len(others) == 3:  # a long prefill shares its next steps
                others.append(ex.enqueue(LONG_PROMPT, SamplingParams(max_tokens=4, temperature=0.7)))
        for other in others:
            assert ex.await_response(other, timeout=120).ok
        stats = ex.speculator.stats if ex.speculator is not None else None
        return tokens, (0, 0) if stats is None else (stats.proposed, stats.accepted)
    finally:
        ex.shutdown()


def test_a_seeded_request_gives_the_same_tokens_whatever_shares_its_batch_with_or_without_a_draft():
    target = model("llama", 1)
    want, _ = seeded_tokens(target, None, crowded=False)
    assert len(want) == SEEDED.max_tokens
    assert seeded_tokens(target, None, crowded=True)[0] == want
    for draft, agrees in ((target, True), (model("llama", 2), False)):
        for crowded in (False, True):
            tokens, (proposed, accepted) = seeded_tokens(target, draft, crowded)
            assert tokens == want, (agrees, crowded)
            assert proposed > 0 and (accepted == proposed if agrees else accepted < proposed)
