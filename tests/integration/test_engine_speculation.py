"""Two-model speculative decoding on the real CPU engine (``bootstrap.engine.spec.speculator``):
greedy output with a draft is the target's own greedy output, token for token, on the tiny
llama, mistral (window 8), qwen2 (a windowed layer) and gemma2 (soft-caps, windows), with a draft
that always agrees (the target's own weights) and one that rarely does (other weights); under
chunked prefill, a stop token or ``max_tokens`` inside an accepted run, ``n`` choices, and a
cancel mid-stream; both pools empty afterwards. Seeded sampling with a draft repeats."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_models import SHAPE
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.executor.profile_run import run_dummy_speculation
from bootstrap.engine.request.sequence import Sequence, next_request_id
from bootstrap.engine.spec.depth import ROW_TOKENS, StepCosts
from bootstrap.engine.spec.speculator import _View
from bootstrap.engine.step.batch import ScheduledBatch
from bootstrap.engine.step.model_runner import ModelRunner

CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "mistral-window": lambda: MistralConfig(**SHAPE, sliding_window=8),
    "qwen2-hybrid-window": lambda: Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "gemma2-softcaps-windows": lambda: Gemma2Config(
        **SHAPE,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    ),
}
PROMPTS = [[(7 * i + 3) % 250 + 3 for i in range(n)] for n in (5, 19, 40)]
TPB = 4


def model(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    config.eos_token_id = config.bos_token_id = None
    built = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param in built.parameters():
            if param.dim() > 1:
                param.mul_(3.0 if name != "gemma2-softcaps-windows" else 1.5)
    return built


def executor(target, draft=None, k: int = 4, num_tokens: int = 16, batch: int = 8):
    """An executor over copies of ``target`` (and ``draft``), chunked prefill of ``num_tokens`` a step."""

    def pool(m):
        return PagedKVCache.from_tokens(KVCacheSpec.from_config(m.config, torch.float32), 2048, TPB, "cpu")

    drafted = None if draft is None else (copy.deepcopy(draft), pool(draft))
    return create_executor(
        copy.deepcopy(target),
        pool(target),
        SchedulerConfig(batch, num_tokens, 256),
        start=False,
        draft=drafted,
        speculative_tokens=k,
    )


def outputs(ex, prompts, params):
    ids = [ex.enqueue(p, params) for p in prompts]
    return [ex.await_response(i, timeout=120) for i in ids]


def empty(ex) -> bool:
    pools = [ex.runner.kv_cache] + ([ex.speculator.pool] if ex.speculator else [])
    return ex.stats().handles == 0 and all(p.stats().used_blocks == 0 for p in pools)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_output_with_a_draft_is_the_targets_own(name):
    target, other = model(name, 1), model(name, 2)
    params = SamplingParams(max_tokens=24, temperature=0)
    plain = executor(target)
    try:
        want = [r.token_ids for r in outputs(plain, PROMPTS, params)]
    finally:
        plain.shutdown()
    for draft, agrees in ((target, True), (other, False)):
        ex = executor(target, draft)
        try:
            got = outputs(ex, PROMPTS, params)
            stats = ex.speculator.stats
            assert [r.token_ids for r in got] == want, (name, agrees)
            assert all(r.finish_reason == "length" for r in got) and empty(ex)
        finally:
            ex.shutdown()
        assert stats.steps > 0 and stats.proposed > 0
        if agrees:  # every proposal kept: 24 tokens in far fewer steps than 24
            assert stats.acceptance_rate == 1.0 and stats.accepted_at == stats.proposed_at
        else:
            assert stats.acceptance_rate < 0.9


def test_stops_and_max_tokens_inside_an_accepted_run_end_where_they_would_without_a_draft():
    target = model("llama", 1)
    plain = executor(target)
    try:
        greedy = outputs(plain, PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0))[0].token_ids
        stop = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[greedy[6]])
        short = SamplingParams(max_tokens=7, temperature=0)
        want = [r.token_ids for r in outputs(plain, PROMPTS[:1] * 2, stop)] + [
            r.token_ids for r in outputs(plain, PROMPTS[:1], short)
        ]
    finally:
        plain.shutdown()
    ex = executor(target, target, k=4)
    try:
        got = list(outputs(ex, PROMPTS[:1] * 2, stop)) + outputs(ex, PROMPTS[:1], short)
        assert [r.token_ids for r in got] == want and len(want[2]) == 7
        assert [r.finish_reason for r in got] == ["stop", "stop", "length"] and empty(ex)
    finally:
        ex.shutdown()


def test_choices_fork_both_pools_and_a_cancel_mid_stream_frees_them():
    target = model("llama", 1)
    ex = executor(target, target)
    try:
        ids = ex.enqueue_choices(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0), 3)
        choices = [ex.await_response(i, timeout=120).token_ids for i in ids]
        assert choices[0] == choices[1] == choices[2] and len(choices[0]) == 12
        request = ex.enqueue(PROMPTS[1], SamplingParams(max_tokens=200, temperature=0))
        stream = ex.stream(request)
        for _ in range(5):
            next(stream)
        stream.close()
        ex.cancel(request)
        assert empty(ex)
    finally:
        ex.shutdown()


def test_seeded_sampling_with_a_draft_repeats_and_keeps_to_max_tokens():
    target, other = model("llama", 1), model("llama", 2)
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        ex = executor(target, other)
        try:
            runs.append([r.token_ids for r in outputs(ex, PROMPTS, params)])
            assert ex.speculator.stats.proposed > 0 and empty(ex)
        finally:
            ex.shutdown()
    assert runs[0] == runs[1] and all(len(tokens) == 20 for tokens in runs[0])


def test_each_step_keeps_exactly_the_verified_tokens_in_both_pools():
    """A 5-token prompt, 21 tokens, k = 4 and a draft that always agrees: one ordinary step (the
    prefill, which samples the first token), then 4 speculative steps of 5 tokens each; after
    every step each pool holds exactly the tokens verified so far, none of the rejected ones."""
    target, other = model("llama", 1), model("llama", 2)
    for draft, speculative_steps in ((target, 4), (other, None)):
        ex = executor(target, draft, k=4)
        forwards = []
        run = ex.runner.run
        ex.runner.run = lambda batch, forwards=forwards, run=run: forwards.append(batch.total_tokens) or run(batch)
        try:
            request = ex.enqueue(PROMPTS[0], SamplingParams(max_tokens=21, temperature=0))
            seq = ex._requests.get(request).seq
            for _ in ex.stream(request):
                if not seq.finished:
                    assert ex.runner.kv_cache.num_tokens(request) == seq.num_computed == seq.num_tokens - 1
                    assert ex.speculator.pool.num_tokens(request) == seq.draft_computed >= seq.num_computed - 1
            assert empty(ex)
        finally:
            ex.shutdown()
        if speculative_steps is not None:
            assert forwards == [5] and ex.speculator.stats.steps == speculative_steps
        else:  # rejections: every step speculates but, when one token is left, the last
            assert forwards[0] == 5 and forwards[1:] in ([], [1])
            assert ex.speculator.stats.accepted < ex.speculator.stats.proposed


def test_the_next_first_pass_is_queued_behind_the_verdict_and_used_only_by_the_same_requests():
    """Each speculative step queues the next one's first draft pass behind its verdict (two rows
    a request, placed on the device by the count kept), so a step then runs ``k - 1`` passes of
    its own. When the batch changes (a request stopped inside a run), that pass goes unused and
    the next step feeds the draft the requests' last tokens again. With the target as its own
    draft every proposal is still kept, and the output is the target's."""
    target = model("llama", 1)
    plain = executor(target)
    try:
        greedy = outputs(plain, PROMPTS[:1], SamplingParams(max_tokens=30, temperature=0))[0].token_ids
        params = [
            SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[greedy[9]]),
            SamplingParams(max_tokens=30, temperature=0),
        ]
        want = [
            plain.await_response(i, timeout=120).token_ids
            for i in [plain.enqueue(p, sp) for p, sp in zip(PROMPTS[:2], params)]
        ]
    finally:
        plain.shutdown()
    ex = executor(target, target, k=4)
    speculator, taken, passes = ex.speculator, [], []
    take, run = speculator._take_ahead, speculator.draft.run_rows

    def spy_take(seqs):
        queued = speculator._ahead is not None
        logits = take(seqs)
        taken.append((queued, logits is not None))
        return logits

    speculator._take_ahead = spy_take
    speculator.draft.run_rows = lambda step, tokens=None, offsets=None, keep=None: (
        passes.append(offsets is not None) or run(step, tokens, offsets, keep)
    )
    try:
        got = [
            ex.await_response(i, timeout=120).token_ids
            for i in [ex.enqueue(p, sp) for p, sp in zip(PROMPTS[:2], params)]
        ]
        assert got == want and len(got[0]) < 30 and empty(ex)
        assert (True, True) in taken and (True, False) in taken  # used, and once not (the batch changed)
        stats = speculator.stats
        assert stats.acceptance_rate == 1.0 and stats.steps == len(taken)  # none failed (and ran without the draft)
        assert passes.count(True) == sum(queued for queued, _ in taken)  # each queued pass met the next step
    finally:
        ex.shutdown()


@pytest.mark.parametrize("agrees", [True, False])
def test_auto_goes_deep_with_a_draft_that_agrees_and_stops_speculating_with_one_that_does_not(agrees):
    target = model("llama", 1)
    draft = target if agrees else model("llama", 2)
    plain = executor(target)
    params = SamplingParams(max_tokens=60, temperature=0)
    try:
        want = [r.token_ids for r in outputs(plain, PROMPTS[:2], params)]
    finally:
        plain.shutdown()
    ex = create_auto(target, draft)
    # a draft a tenth of the target's cost, passes as fast as a decode step (the tiny test models are
    # the same size, and on 2 shared cores the measured timings would decide by noise)
    ex.speculator.costs = FixedCosts(prior=0.1, decode=1.0)
    forwards = []
    run = ex.runner.run
    ex.runner.run = lambda batch: forwards.append(batch.total_tokens) or run(batch)
    try:
        assert [r.token_ids for r in outputs(ex, PROMPTS[:2], params)] == want and empty(ex)
    finally:
        ex.shutdown()
    stats = ex.speculator.stats
    if agrees:  # deeper than the prior's depth once full runs come back, up to the ceiling of 8
        assert len(stats.proposed_at) == 8 and stats.acceptance_rate == 1.0 and len(forwards) <= 6
    else:  # a few steps to learn it, then ordinary steps, with one probing proposal every 16 steps
        assert stats.acceptance_rate < 0.5 and stats.steps < 15 and len(forwards) > 40


def create_auto(target, draft):
    def pool(m):
        return PagedKVCache.from_tokens(KVCacheSpec.from_config(m.config, torch.float32), 2048, TPB, "cpu")

    return create_executor(
        copy.deepcopy(target),
        pool(target),
        SchedulerConfig(8, 16, 256),
        start=False,
        draft=(copy.deepcopy(draft), pool(draft)),
        speculative_tokens=8,
        adaptive=True,
    )


class FixedCosts(StepCosts):
    """Step costs that measurements do not move: the depth follows the acceptance alone."""

    def record(self, what: str, seconds: float) -> None:
        pass


class ScriptedCosts(StepCosts):
    """Step costs whose measurements read as ``figures`` (seconds per kind) whatever the wall time
    was, taken through ``StepCosts.record`` as a measurement is; ``kinds``: what was measured, in order."""

    def __init__(self, prior: float, figures: dict[str, float]) -> None:
        super().__init__(prior)
        self.figures, self.kinds = figures, []

    def record(self, what: str, seconds: float) -> None:
        self.kinds.append(what)
        super().record(what, self.figures[what])


def test_auto_measures_a_decode_step_first_and_stops_when_its_passes_cannot_pay():
    """The first decode step runs alone (what speculating must beat); once a verify pass is
    measured to cost as much as the decode steps that its tokens replace, speculating stops for
    good, whatever the acceptance (a draft that always agrees here), and output stays the target's.
    The measurements are scripted (a verify pass ten decode steps long: dearer than the k + 1 its
    tokens replace), so the outcome does not hang on the load of the machine."""
    target = model("llama", 1)
    ex = create_auto(target, target)
    # measured from here on; the prior of a draft a tenth of the target
    ex.speculator.costs = costs = ScriptedCosts(prior=0.1, figures={"decode": 1.0, "verify": 10.0, "draft": 0.1})
    try:
        got = outputs(ex, PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0))[0].token_ids
        assert costs.kinds[0] == "decode" and costs.kinds.count("verify") == 1
        assert ex.speculator.costs.decode == 1.0 and ex.speculator.stats.steps == 1 and empty(ex)
    finally:
        ex.shutdown()
    plain = executor(target)
    try:
        assert got == outputs(plain, PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0))[0].token_ids
    finally:
        plain.shutdown()


@pytest.mark.parametrize("name", CONFIGS)
def test_rows_of_one_request_score_each_position_as_the_whole_sequence_does(name):
    """A verify pass: one request's tokens as rows at consecutive positions, after a prefill,
    give at each row the logits the model gives at that position over the whole sequence; ids
    given on the device in place of the host's do the same."""
    target = model(name, 1)
    want = target(input_ids=torch.tensor([PROMPTS[1]])).logits[0, 14:19]
    pool = PagedKVCache.from_tokens(KVCacheSpec.from_config(target.config, torch.float32), 256, TPB, "cpu")
    runner = ModelRunner(copy.deepcopy(target), pool, 4, 256, max_rows=20)
    pool.allocate(7, 19)
    runner.run(ScheduledBatch([_View(7, PROMPTS[1][:14], 0)], [14]))
    rows = runner.token_rows([(7, 14, PROMPTS[1][14:19])])
    assert rows.positions == [14, 15, 16, 17, 18] and len({tuple(t) for t in rows.tables}) == 1
    torch.testing.assert_close(runner.run_rows(rows), want, atol=1e-4, rtol=1e-4)
    blind = runner.token_rows([(7, 14, [0] * 5)])
    torch.testing.assert_close(runner.run_rows(blind, torch.tensor(PROMPTS[1][14:19])), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="max_rows"):
        runner.run_rows(runner.token_rows([(7, 0, [1] * 19), (7, 0, [1] * 2)]))


@pytest.mark.parametrize("auto", [False, True])
def test_a_catch_up_runs_as_rows_in_passes_of_the_drafts_max_rows(auto):
    """Tokens the draft lacks (``auto`` resuming a request that paused, a short prompt) run as
    rows, not as a mixed step: in passes of the draft's ``max_rows`` (4 for a fixed depth at
    batch 2), or with ``auto``, whose draft holds ``ROW_TOKENS`` rows a request, in one pass
    that computes logits at each request's last row only. Either way each request's logits
    are those of its whole sequence at its last token."""
    draft = model("llama", 2)
    ex = create_auto(model("llama", 1), draft) if auto else executor(model("llama", 1), draft, k=3, batch=2)
    speculator, sizes = ex.speculator, []
    run = speculator.draft.run_rows

    def spy(step, tokens=None, offsets=None, keep=None):
        logits = run(step, tokens, offsets, keep)
        sizes.append((step.size, logits.shape[0]))
        return logits

    speculator.draft.run_rows, speculator.draft.run = spy, None  # a mixed step would fail here
    requests = [(next_request_id(), PROMPTS[1][:12]), (next_request_id(), PROMPTS[2][:9])]
    try:
        for request_id, tokens in requests:
            speculator.pool.allocate(request_id, len(tokens))
        got = speculator._feed([_View(request_id, tokens, 0) for request_id, tokens in requests])
        want = torch.stack([draft(input_ids=torch.tensor([tokens])).logits[0, -1] for _, tokens in requests])
        assert sizes == ([(21, 2)] if auto else [(4, 0), (4, 0), (4, 1), (4, 0), (4, 0), (1, 1)])
        assert speculator.draft.max_rows == (8 * ROW_TOKENS if auto else 4)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        for request_id, _ in requests:
            speculator.pool.free(request_id)
        ex.shutdown()


def test_the_dummy_speculative_step_runs_every_pass_at_its_largest_and_keeps_nothing():
    """Profiling's dummy speculative step: the draft's first pass over two rows per request and
    ``k - 1`` passes of one, the verify pass over ``k + 1``, sampled, and the next first pass
    queued ahead (two rows again); both pools empty after, and it refuses pools that hold a
    request."""
    target = model("llama", 1)
    ex = executor(target, model("llama", 2), k=3, batch=4)
    sizes = {"target": [], "draft": []}
    for name, runner in (("target", ex.runner), ("draft", ex.speculator.draft)):

        def spy(step, tokens=None, offsets=None, keep=None, run=runner.run_rows, name=name):
            sizes[name].append(step.size)
            return run(step, tokens, offsets, keep)

        runner.run_rows = spy
    try:
        run_dummy_speculation(ex.speculator, 4)
        assert sizes == {"target": [16], "draft": [8, 4, 4, 8]} and empty(ex)
        ex.speculator.pool.allocate(99, 3)
        with pytest.raises(RuntimeError, match="empty pools"):
            run_dummy_speculation(ex.speculator, 4)
    finally:
        ex.speculator.pool.free(99)
        ex.shutdown()


def test_auto_does_not_take_a_step_that_fed_the_draft_for_a_decode_step():
    """``auto`` weighs speculating against ordinary decode steps; one in which the draft was fed
    too (a request catching up) is not one of them, else decoding would look dearer than it is."""
    target = model("llama", 1)
    ex = create_auto(target, target)
    speculator = ex.speculator
    seq = Sequence(next_request_id(), list(PROMPTS[0]), SamplingParams(max_tokens=8))
    seq.append(9)
    ex.runner.kv_cache.allocate(seq.request_id, seq.num_tokens)
    seq.num_computed = seq.num_tokens - 1  # a decode step of its last token
    batch = ScheduledBatch([seq], [1])
    try:
        speculator.costs = StepCosts(prior=0.1)  # a draft a tenth of the target: speculating pays
        speculator.costs.record("decode", 0.01)
        speculator.mirror(batch)  # the draft holds nothing of it: fed the whole sequence
        assert seq.draft_computed == seq.num_tokens
        speculator.ordinary(batch, 5.0)
        assert speculator.costs.decode == 0.01
        speculator.mirror(batch)  # nothing left to feed
        speculator.ordinary(batch, 0.02)
        assert speculator.costs.decode == pytest.approx(0.7 * 0.01 + 0.3 * 0.02)  # rises by the decay
    finally:
        speculator.pool.free(seq.request_id)
        ex.runner.kv_cache.free(seq.request_id)
        ex.shutdown()


def test_auto_takes_no_draft_figure_from_a_step_that_caught_up_and_the_next_one_replaces_it():
    """A step whose first draft pass caught up on many tokens (a request resuming) says nothing
    of what a draft pass costs: its figure is not taken. The next step's is, and, being lower,
    replaces a figure too high at once (only speculative steps measure it: a figure that stopped
    speculation would never be measured again)."""
    target = model("llama", 1)
    ex = create_auto(target, target)
    speculator = ex.speculator
    seq = Sequence(next_request_id(), list(PROMPTS[1]), SamplingParams(max_tokens=40, temperature=0))
    seq.append(9)
    ex.runner.kv_cache.allocate(seq.request_id, seq.num_tokens)
    seq.num_computed = seq.num_tokens - 1  # a decode step of its last token; the draft holds none of it
    try:
        speculator.costs = StepCosts(prior=0.1)
        speculator.costs.draft = 123.0  # far too high: a draft pass of two minutes

        def step() -> None:
            for token in speculator.step(ScheduledBatch([seq], [1]), [2])[0]:
                seq.append(token)
            ex.runner.kv_cache.extend(seq.request_id, 1)  # the next step's own token, as the scheduler does

        step()
        assert speculator.costs.draft == 123.0 and speculator.costs.verify is not None  # caught up on 20 tokens
        step()
        assert speculator.costs.draft < 1.0 and speculator.stats.steps == 2
    finally:
        speculator.pool.free(seq.request_id)
        ex.runner.kv_cache.free(seq.request_id)
        ex.shutdown()


def test_a_step_whose_one_draft_pass_was_queued_ahead_takes_no_draft_figure():
    """Near a request's end its depth falls to what it may still write. A step of one proposal
    whose one draft pass the last step queued ahead runs no pass of its own: its drafting time
    says nothing of a pass (taken, it read near 0 on the H200 and, falling at once, made drafting
    look free). A step of four with its first pass queued ahead still gives a figure."""
    target = model("llama", 1)
    ex = executor(target, target, k=4, batch=1)
    speculator = ex.speculator
    seq = Sequence(next_request_id(), list(PROMPTS[1]), SamplingParams(max_tokens=40, temperature=0))
    seq.append(9)
    ex.runner.kv_cache.allocate(seq.request_id, seq.num_tokens)
    seq.num_computed = seq.num_tokens - 1  # a decode step of its last token; the draft holds none of it

    def step(depth: int) -> None:
        for token in speculator.step(ScheduledBatch([seq], [1]), [depth])[0]:
            seq.append(token)
        ex.runner.kv_cache.extend(seq.request_id, 1)  # the next step's own token, as the scheduler does

    try:
        step(4)  # catches up: no figure; queues the next first pass
        for depth, taken in ((4, True), (1, False)):
            assert speculator._ahead is not None and speculator._ahead.key == ((seq.request_id, seq.num_tokens),)
            speculator.costs.draft = 7.0  # far too high: any figure taken replaces it at once
            step(depth)
            assert speculator.costs.draft < 1.0 if taken else speculator.costs.draft == 7.0
        assert speculator.stats.steps == 3
    finally:
        speculator.pool.free(seq.request_id)
        ex.runner.kv_cache.free(seq.request_id)
        ex.shutdown()


def test_auto_times_a_decode_step_again_every_so_many_speculative_steps(monkeypatch):
    """A first decode figure far too high (say, a step that took a first-use cost) would keep
    ``auto`` speculating for good; one step in ``REMEASURE_EVERY + 1`` runs alone, the draft not
    fed, and is timed again, and the output stays the target's."""
    monkeypatch.setattr("bootstrap.engine.spec.speculator.REMEASURE_EVERY", 4)
    target = model("llama", 1)
    ex = create_auto(target, target)
    ex.speculator.costs = StepCosts(prior=0.1)
    ex.speculator.costs.record("decode", 5.0)  # stale: five seconds a decode step
    params = SamplingParams(max_tokens=120, temperature=0)
    try:
        got = outputs(ex, PROMPTS[:1], params)[0].token_ids
        assert ex.speculator.costs.decode < 2.5 and empty(ex)  # timed again at least twice (a decay of 0.7 each)
    finally:
        ex.shutdown()
    plain = executor(target)
    try:
        assert got == outputs(plain, PROMPTS[:1], params)[0].token_ids
    finally:
        plain.shutdown()
