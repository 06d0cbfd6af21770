"""Two-model speculative decoding in the engine loop, explained here once (``docs/design.md``
points here): a draft model on its own KV pool proposes ``k`` tokens per running request, the
target verifies them in one forward, and the acceptance rules (``spec.verify``) keep what the
target would have produced. Every ordinary step also feeds the draft what the target computed
(``mirror``), so both pools hold each request's tokens (``Sequence.draft_computed``) and the ``n``
choices of a prompt fork both. A speculative step (``step``, all requests in decode): ``k`` draft
passes, one verify pass, the verdict, both pools cut back to the kept tokens. Every pass is a
step of one-token rows (``ModelRunner.run_rows``, rows in ``spec.rows``) that replays a CUDA graph
captured in ``warmup``; proposals stay on the device and the host waits once, for the verdict,
after queueing the next step's first draft pass (``_queue_ahead``). The depth is capped by the
request with the least room left (``plan``; per request with ``auto``: ``spec.depth``), so a
verify pass never writes past a reservation; rows with penalties, pending ``min_tokens`` or
logprobs, and prefill chunks run as ordinary steps, as does a step that raised (``_undo``).
A seeded request gets the tokens it gets without a draft, whatever its batch (``spec.judge``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.request.sequence import Sequence
from bootstrap.engine.sampling.argmax import argmax
from bootstrap.engine.sampling.processing import History, needs_processing
from bootstrap.engine.sampling.sampler import Sampler
from bootstrap.engine.spec.depth import PROBE_EVERY, REMEASURE_EVERY, ROW_TOKENS, StepCosts, best_depth
from bootstrap.engine.spec.judge import draw, judge
from bootstrap.engine.spec.metrics import SpeculationStats, StepClock
from bootstrap.engine.spec.verify import Verdict
from bootstrap.engine.step.batch import ScheduledBatch
from bootstrap.engine.step.decode_step import DecodeStep, queued_tensor, request_runs
from bootstrap.engine.step.model_runner import ModelRunner


@dataclass(eq=False)
class _View:
    """A request as one pass sees it: its tokens up to this pass's last one, ``num_computed`` of
    them already in the pool the pass writes (what ``ModelRunner`` reads of a ``Sequence``)."""

    request_id: int
    token_ids: list[int]
    num_computed: int
    in_flight: int = 0  # a speculative step reads its tokens before the next one (no overlap)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def in_prefill(self) -> bool:
        return False


class Speculator:
    """The draft's runner on its pool, and the speculative step; see the module docstring."""

    def __init__(
        self,
        draft: ModelRunner,
        target: ModelRunner,
        sampler: Sampler,
        k: int,
        max_seq_len: int,
        adaptive: bool = False,
    ) -> None:
        """``k``: the depth, or with ``adaptive`` (``auto``) the deepest a request may go."""
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.vocab_size}) must be the target's ({target.vocab_size})")
        self.draft, self.target, self.sampler = draft, target, sampler
        self.k, self.max_seq_len, self.adaptive = k, max_seq_len, adaptive
        # auto: what the passes take, as measured; the prior is the draft's weight bytes over the
        # target's (decode reads every weight once)
        self.costs = StepCosts(_weight_bytes(draft.model) / max(_weight_bytes(target.model), 1))
        self.stats = SpeculationStats()
        self._mirrored = False  # whether the current ordinary step fed the draft (``ordinary``)
        self._since_measured = 0  # speculative steps since an ordinary decode step was timed (``auto``)
        self._ahead: _Ahead | None = None  # the next step's first draft pass, queued by the last step

    @property
    def cost(self) -> float:
        """A draft pass against a target pass, by weight bytes (``auto``'s prior)."""
        return self.costs.prior

    @property
    def pool(self) -> PagedKVCache:
        return self.draft.kv_cache

    # ---- which steps speculate ------------------------------------------------------------------

    def plan(self, batch: ScheduledBatch) -> list[int] | None:
        """How many proposals each request of this step considers (None: an ordinary step). The
        step proposes the most of them for every row, never more than the request with the least
        room left has (``max_tokens``, ``max_seq_len``): the verify pass writes that many slots."""
        if not batch.is_decode or batch.rows is not None:
            return None
        if self.adaptive and (self._measuring or best_depth(1.0, self.costs, self.k) == 0):
            return None  # a decode step alone, to know what speculating must beat; or it cannot pay at all
        room = self.k
        for seq in batch.seqs:
            if seq.forks or seq.params.logprobs is not None or needs_processing(seq.params, _history(seq)):
                return None
            left = seq.params.max_tokens - len(seq.output_token_ids)  # tokens it may still get
            room = min(room, left - 1, self.max_seq_len - seq.num_tokens)
        limits = [min(self._wanted(seq), room) for seq in batch.seqs] if self.adaptive else [room] * len(batch.seqs)
        return limits if max(limits, default=0) > 0 else None

    def _wanted(self, seq: Sequence) -> int:
        """``auto``: the request's best depth from its acceptance and the measured costs; at 0,
        one proposal every ``PROBE_EVERY`` steps, so a draft that starts agreeing again is
        noticed (``plan`` asks only while some acceptance could pay for speculating)."""
        depth = best_depth(seq.acceptance.rate, self.costs, self.k)
        if depth == 0:
            seq.acceptance.idle_steps += 1
            if seq.acceptance.idle_steps >= PROBE_EVERY:
                return 1
        return depth

    def keeps_up(self, seq: Sequence) -> bool:
        """Whether ordinary steps feed the draft this request's tokens: always with a fixed depth;
        with ``auto`` only while it speculates (one that does not catches up when it tries again)."""
        if not self.adaptive:
            return True
        return not self._measuring and best_depth(seq.acceptance.rate, self.costs, self.k) > 0

    @property
    def _measuring(self) -> bool:
        """``auto``: the next decode step runs alone, the draft not fed in it, and is timed: the
        first one, then one every ``REMEASURE_EVERY`` speculative steps (what decoding costs
        drifts with the batch and the contexts; measured only while speculating does not pay,
        a first figure that was too high would keep it speculating for good)."""
        return self.costs.decode is None or self._since_measured >= REMEASURE_EVERY

    def ordinary(self, batch: ScheduledBatch, seconds: float) -> None:
        """An ordinary step of ``batch`` took ``seconds``: a decode-only one is what speculating
        must beat (``auto``), unless ``mirror`` fed the draft in it (the step then took the
        draft's pass too, and a request catching up after a pause makes that pass long; counted,
        such steps would make decoding look dearer than it is, and speculating pay when it does not)."""
        if batch.is_decode and not self._mirrored:
            self.costs.record("decode", seconds)
            self._since_measured = 0
        self._mirrored = False
        self._ahead = None  # its requests have a token more now: the pass queued ahead is of no use

    # ---- the draft keeping up -------------------------------------------------------------------

    def mirror(self, batch: ScheduledBatch) -> None:
        """Before ``batch``'s requests advance: feed the draft what the target computes in this
        ordinary step, so both pools hold the same tokens (logits unused)."""
        fed = [
            (seq, _View(seq.request_id, seq.token_ids[: seq.num_computed + count], seq.draft_computed))
            for seq, count in zip(batch.seqs, batch.num_new_tokens)
            if seq.num_computed + count > seq.draft_computed and self.keeps_up(seq)
        ]
        self._mirrored = bool(fed)
        if fed:
            for seq, view in fed:
                self._fed(seq, view.num_tokens)
            self._feed([view for _, view in fed])
            for seq, view in fed:
                seq.draft_computed = view.num_tokens

    def _feed(self, views: list[_View]) -> torch.Tensor:
        """The draft over the tokens each view adds to its pool: logits ``[B, V]`` at each one's
        last token. A few tokens a request (a decode step's, a speculative step's catching up,
        ``auto`` resuming a request that paused) run as rows, in passes of the draft's
        ``pass_rows`` (its largest graph; without graphs ``max_rows``, with ``auto`` room for
        every request's catching up at once); more (a prompt chunk) as a mixed step, which
        gathers the cached context and builds masked attention for its shapes, measured far
        slower than row passes (benchmarks/README.md, Speculative decoding)."""
        counts = [view.num_tokens - view.num_computed for view in views]
        if max(counts) > ROW_TOKENS:
            return self.draft.run(ScheduledBatch(views, counts))
        rows = [
            (v.request_id, v.num_computed + i, token)
            for v in views
            for i, token in enumerate(v.token_ids[v.num_computed :])
        ]
        ends = [end - 1 for end in itertools.accumulate(counts)]  # each view's last row
        passes = []
        size = self.draft.pass_rows
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            wanted = [end - start for end in ends if start <= end < start + len(chunk)]
            keep = None if wanted == list(range(len(chunk))) else wanted
            passes.append(self.draft.run_rows(self.draft.token_rows(request_runs(chunk)), keep=keep))
        return passes[0] if len(passes) == 1 else torch.cat(passes)

    # ---- the speculative step -------------------------------------------------------------------

    def step(self, batch: ScheduledBatch, limits: list[int]) -> list[list[int]]:
        """Propose ``max(limits)`` tokens per request, verify them, judge each row's first
        ``limits[i]``, cut both pools back; each request's new tokens (its kept proposals, then
        the target's next token). The requests' ``num_computed`` and ``draft_computed`` are
        updated; their tokens are left for the caller to append."""
        seqs, k = batch.seqs, max(limits)
        starts = [(seq.num_computed, seq.num_tokens, seq.draft_computed) for seq in seqs]
        lagging = any(
            seq.num_tokens - seq.draft_computed > 2 for seq in seqs
        )  # a long first pass: not a draft pass's cost
        ran_none = k == 1 and self._queued_for(seqs)  # its one draft pass was the last step's, queued ahead
        try:
            clock = StepClock(self.target.device)
            proposals, q = self._propose(seqs, k)
            clock.drafted()
            logits = self._verify(seqs, proposals, k)
            verdict = judge(self.sampler, seqs, proposals, q, logits, queued_tensor(logits.device, limits))
            clock.verified()
            on_host = verdict.to_host()
            ahead = self._queue_ahead(seqs, proposals, verdict, k)
            runs = on_host.new_tokens()  # the step's one wait for the device
        except BaseException:
            self._undo(seqs, starts)
            raise
        drafting, verifying = clock.split()
        if not (lagging or ran_none):  # per pass, the one queued ahead counted: what the device did not hide of it
            self.costs.record("draft", drafting / k)  # is in the wall time
        self.costs.record("verify", verifying)
        for seq, (computed, length, _), run, limit in zip(seqs, starts, runs, limits):
            kept = len(run) - 1
            seq.num_computed = computed + 1 + kept
            seq.draft_computed = length + len(run) if ahead is not None else min(seq.draft_computed, length + kept)
            self.target.kv_cache.truncate(seq.request_id, seq.num_computed)
            self.pool.truncate(seq.request_id, seq.draft_computed)
            if limit:
                seq.acceptance.observe(limit, kept)
        if ahead is not None:
            self._ahead = _Ahead(tuple((seq.request_id, seq.draft_computed) for seq in seqs), ahead)
        self.stats.count(limits, [len(run) - 1 for run in runs])
        self._since_measured += 1
        return runs

    def _propose(self, seqs: list[Sequence], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` proposals per request ``[B, k]``, and the draft's distributions ``[B, k, V]`` when
        any row samples (None when all are greedy): ``k`` draft passes, the first of them queued
        by the last step when it was of these requests (``_queue_ahead``). The host never waits
        for a pass: each pass's tokens feed the next on the device."""
        greedy = all(seq.params.greedy for seq in seqs)
        for seq in seqs:  # the slots the k passes write: what the draft lacks, then k - 1 proposals
            self._fed(seq, seq.num_tokens + k - 1)
        dists: list[torch.Tensor] = []
        ahead = self._take_ahead(seqs)
        drawn = [self._draw_pass(seqs, self._catch_up(seqs) if ahead is None else ahead, greedy, dists)]
        for j in range(1, k):  # pass j feeds proposal j at position num_tokens - 1 + j
            step = self.draft.token_rows([(seq.request_id, seq.num_tokens - 1 + j, (0,)) for seq in seqs])
            drawn.append(self._draw_pass(seqs, self.draft.run_rows(step, drawn[-1]), greedy, dists))
        for seq in seqs:
            seq.draft_computed = seq.num_tokens + k - 1
        device = self.target.device
        return torch.stack(drawn, dim=1).to(device), (torch.stack(dists, dim=1).to(device) if dists else None)

    def _take_ahead(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The logits the last step's queued pass left for these requests, if it was queued for
        exactly them as they are now; used once."""
        logits = self._ahead.logits if self._queued_for(seqs) else None
        self._ahead = None
        return logits

    def _queued_for(self, seqs: list[Sequence]) -> bool:
        """Whether the pass queued ahead was queued for exactly these requests as they are now."""
        return self._ahead is not None and self._ahead.key == tuple((seq.request_id, seq.num_tokens) for seq in seqs)

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """The first draft pass, over what the draft lacks of each request, at least its last
        token (a pass queued ahead fed it, but for another batch): logits ``[B, V]``."""
        return self._feed(
            [_View(seq.request_id, seq.token_ids, min(seq.draft_computed, seq.num_tokens - 1)) for seq in seqs]
        )

    def _queue_ahead(
        self, seqs: list[Sequence], proposals: torch.Tensor, verdict: Verdict, k: int
    ) -> torch.Tensor | None:
        """The next step's first draft pass, queued behind the verdict before the host reads it,
        so the device works while the host does the step's bookkeeping and schedules the next:
        each request's last kept token and the target's own, two rows at positions the count
        kept moves on the device (``DecodeBuffers.fill``). Its logits at the second row
        ``[B, V]``, or None (nothing queued) where a request may end with this step, or where
        ``auto`` times a decode step next (that step would carry this pass)."""
        if self.adaptive and self._since_measured + 1 >= REMEASURE_EVERY:
            return None
        for seq in seqs:
            if seq.params.max_tokens - len(seq.output_token_ids) <= k + 1 or seq.num_tokens + k + 1 > self.max_seq_len:
                return None
        for seq in seqs:  # what the rows may write: up to the target's token after k kept
            self._fed(seq, seq.num_tokens + k + 1)
        accepted = verdict.accepted
        last = queued_tensor(proposals.device, [seq.token_ids[-1] for seq in seqs])  # what precedes a run of none kept
        before = torch.where(accepted > 0, proposals.gather(1, (accepted - 1).clamp_min(0)[:, None])[:, 0], last)
        target = verdict.tokens.gather(1, accepted[:, None])[:, 0]
        ids = torch.stack([before, target], dim=1).reshape(-1).to(self.draft.device)
        step = self.draft.token_rows([(seq.request_id, seq.num_tokens - 1, (0, 0)) for seq in seqs])
        logits = self.draft.run_rows(step, ids, accepted.repeat_interleave(2).to(self.draft.device))
        return logits.view(len(seqs), 2, -1)[:, 1].clone()  # a graph's logits live until its next replay

    def _draw_pass(
        self, seqs: list[Sequence], logits: torch.Tensor, greedy: bool, dists: list[torch.Tensor]
    ) -> torch.Tensor:
        """One proposal per row ``[B]`` from a draft pass's logits; a sampling batch appends the
        draft's distributions to ``dists``."""
        if greedy:
            return argmax(logits)
        probs = self.sampler.probabilities(logits, [seq.params for seq in seqs])
        ahead = len(dists)  # the pass proposes each request's output token this far past its last
        dists.append(probs)
        return torch.stack([draw(seq, row, ahead) for seq, row in zip(seqs, probs)])

    def _fed(self, seq: Sequence, tokens: int) -> None:
        """Grow the draft's pool to hold ``tokens`` of ``seq``."""
        if not self.pool.holds(seq.request_id):
            self.pool.allocate(seq.request_id, tokens)
        elif tokens > self.pool.num_tokens(seq.request_id):
            self.pool.extend(seq.request_id, tokens - self.pool.num_tokens(seq.request_id))

    def _verify(self, seqs: list[Sequence], proposals: torch.Tensor, k: int) -> torch.Tensor:
        """The target over each request's last token and its proposals, a row each (each layer
        writes the step's keys before it attends, so a row sees its request's earlier rows):
        logits ``[B, k + 1, V]``."""
        rows = []
        for seq in seqs:
            self.target.kv_cache.extend(seq.request_id, k)  # the step's own token is already in
            rows.append((seq.request_id, seq.num_computed, [seq.token_ids[-1]] + [0] * k))
        return self.target.run_rows(self.target.token_rows(rows), proposals).view(len(seqs), k + 1, -1)

    def rehearse(self, seqs: list[Sequence]) -> None:
        """A speculative step of ``seqs`` at full depth, its tokens thrown away: the draft's
        first pass over two rows per request and its ``k - 1`` further passes, the verify pass
        over ``k + 1`` rows per request, the judging, and the next first pass queued ahead
        (profiling: its peak must include a step's). Every row writes slot 0 of block 0, so
        both pools must hold no request."""
        rows, k = len(seqs), self.k
        greedy = all(seq.params.greedy for seq in seqs)
        dists: list[torch.Tensor] = []
        drawn = [self._draw_pass(seqs, self.draft.run_rows(DecodeStep.dummy(2 * rows))[:rows], greedy, dists)]
        for _ in range(1, k):
            drawn.append(self._draw_pass(seqs, self.draft.run_rows(DecodeStep.dummy(rows), drawn[-1]), greedy, dists))
        proposals, q = torch.stack(drawn, dim=1), torch.stack(dists, dim=1) if dists else None
        logits = self.target.run_rows(DecodeStep.dummy(rows * (k + 1))).view(rows, k + 1, -1)
        on_host = judge(
            self.sampler, seqs, proposals, q, logits, torch.full((rows,), k, device=logits.device)
        ).to_host()
        still = torch.zeros(2 * rows, dtype=torch.long, device=self.draft.device)  # moved by nothing kept
        self.draft.run_rows(DecodeStep.dummy(2 * rows), offsets=still).view(rows, 2, -1)[:, 1].clone()
        on_host.new_tokens()

    def _undo(self, seqs: list[Sequence], starts: list[tuple[int, int, int]]) -> None:
        """A step that raised: both pools back to what the requests held before it (the target's
        with this step's own token, as ``Scheduler.schedule`` left it), nothing queued ahead."""
        self._ahead = None
        for seq, (computed, _, drafted) in zip(seqs, starts):
            seq.num_computed, seq.draft_computed = computed, drafted
            for pool, keep in ((self.target.kv_cache, computed + 1), (self.pool, drafted)):
                if pool.holds(seq.request_id) and pool.num_tokens(seq.request_id) > keep:
                    pool.truncate(seq.request_id, keep)


@dataclass(frozen=True)
class _Ahead:
    """A pass ``_queue_ahead`` queued: logits ``[B, V]`` at each request's last token, for the
    next step of these requests holding these many tokens (``key``: (request id, tokens))."""

    key: tuple[tuple[int, int], ...]
    logits: torch.Tensor


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _history(seq: Sequence) -> History:
    return History(seq.token_ids, seq.num_prompt_tokens)
