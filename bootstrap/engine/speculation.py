"""Two-model speculative decoding in the engine loop: a draft model on its own KV pool proposes
``k`` tokens per running request, the target verifies them in one forward, and the acceptance
rules (``bootstrap.engine.speculative``) keep what the target would have produced.

The draft keeps up with the target: after every ordinary step (prefill chunks, mixed steps)
``mirror`` runs the draft over the tokens the target just computed, so a request's prompt is
in both pools and the ``n`` choices of a prompt fork both. ``Sequence.draft_computed`` counts
the tokens in the draft's pool; after a speculative step it may trail the target by one (when
all ``k`` proposals were kept, the last one was never fed to the draft), and the next step's
first draft pass catches up.

A speculative step (``step``), for a step of requests all in decode:

1. ``k`` draft passes: the first feeds what the draft lacks (the request's last token, and the
   one before it after a full acceptance), each next one the token just proposed; greedy rows
   propose the argmax, sampled rows draw from the draft's distribution ``q``.
2. One target pass over each request's last token and its ``k`` proposals: logits at all
   ``k + 1`` positions.
3. The verdict per row; both pools are cut back to the tokens that were verified
   (``PagedKVCache.truncate``): the rejected proposals' slots are given back.

Every pass is a step of one-token rows (``ModelRunner.run_rows``): the verify pass gives a
request ``k + 1`` rows at consecutive positions, a catching-up draft pass two, so each pass
replays a CUDA graph captured for its rows (``warmup`` captures the target's verify rows and the
draft's passes). The proposals stay on the device, each pass's tokens the next one's input, so
the step waits for the device once, for the verdict.

A step proposes the same number of tokens for every row: at most the configured ``k`` and what
the request with the least room left may still write (``max_tokens``, ``max_seq_len``); with
``auto`` each row then judges only as many as its own depth (``plan``). A step whose requests cannot all
speculate (a prefill chunk, a row with penalties, ``min_tokens`` pending or logprobs asked, a
request that still carries choices to fork) runs as an ordinary step. Seeded requests repeat
with speculation, but their tokens are not those of the same seed without it: the draws differ,
the distribution does not.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from bootstrap.engine.decode_step import DecodeStep
from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.logits_processing import History, needs_processing
from bootstrap.engine.model_runner import ModelRunner
from bootstrap.engine.sampling import Sampler
from bootstrap.engine.scheduler import ScheduledBatch
from bootstrap.engine.sequence import Sequence
from bootstrap.engine.speculative import (
    PROBE_EVERY,
    REMEASURE_EVERY,
    StepCosts,
    Verdict,
    accept_greedy,
    accept_sampled,
    best_depth,
)


@dataclass(eq=False)
class _View:
    """A request as one pass sees it: its tokens up to this pass's last one, ``num_computed`` of
    them already in the pool the pass writes (what ``ModelRunner`` reads of a ``Sequence``)."""

    request_id: int
    token_ids: list[int]
    num_computed: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def in_prefill(self) -> bool:
        return False


@dataclass
class SpeculationStats:
    """Proposals and acceptances since the executor started, per draft position too."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i]: proposals kept at draft position i
    proposed_at: list[int] = field(default_factory=list)

    def count(self, limits: Seq[int], accepted: Seq[int]) -> None:
        """One step: row ``i`` judged ``limits[i]`` proposals and kept ``accepted[i]``."""
        self.steps += 1
        self.proposed += sum(limits)
        self.accepted += sum(accepted)
        for position in range(max(limits)):
            if position >= len(self.proposed_at):
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[position] += sum(limit > position for limit in limits)
            self.accepted_at[position] += sum(n > position for n in accepted)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def to_dict(self) -> dict:
        """``bootstrap run --json``'s ``speculation``: counts, the acceptance rate, the mean
        accepted run per step and row, and the acceptance rate at each draft position."""
        rows = self.proposed_at[0] if self.proposed_at else 0
        return {"steps": self.steps, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.accepted / rows, 4) if rows else None,
                "acceptance_by_position": [round(a / p, 4) for a, p in zip(self.accepted_at, self.proposed_at)]}  # fmt: skip


class Speculator:
    """The draft's runner on its pool, and the speculative step; see the module docstring."""

    def __init__(self, draft: ModelRunner, target: ModelRunner, sampler: Sampler, k: int, max_seq_len: int,
                 adaptive: bool = False) -> None:  # fmt: skip
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

    # ---- the draft keeping up -------------------------------------------------------------------

    def mirror(self, batch: ScheduledBatch) -> None:
        """Before ``batch``'s requests advance: feed the draft what the target computes in this
        ordinary step, so both pools hold the same tokens (logits unused)."""
        fed = [(seq, _View(seq.request_id, seq.token_ids[: seq.num_computed + count], seq.draft_computed))
               for seq, count in zip(batch.seqs, batch.num_new_tokens)
               if seq.num_computed + count > seq.draft_computed and self.keeps_up(seq)]  # fmt: skip
        self._mirrored = bool(fed)
        if fed:
            for seq, view in fed:
                self._fed(seq, view.num_tokens)
            self._feed([view for _, view in fed])
            for seq, view in fed:
                seq.draft_computed = view.num_tokens

    def _feed(self, views: list[_View]) -> torch.Tensor:
        """The draft over the tokens each view adds to its pool: logits ``[B, V]`` at each one's
        last token. A few tokens a request (a decode step's, a catching-up pass's) run as rows,
        a captured graph's; more (a prompt chunk, ``auto`` resuming a request that stopped
        speculating) as a mixed step."""
        counts = [view.num_tokens - view.num_computed for view in views]
        if sum(counts) > self.draft.max_rows:
            return self.draft.run(ScheduledBatch(views, counts))
        step = self.draft.token_rows([(v.request_id, v.num_computed, v.token_ids[v.num_computed :]) for v in views])
        logits = self.draft.run_rows(step)
        if step.size == len(views):
            return logits
        return logits.index_select(0, _on(logits.device, [end - 1 for end in itertools.accumulate(counts)]))

    # ---- the speculative step -------------------------------------------------------------------

    def step(self, batch: ScheduledBatch, limits: list[int]) -> list[list[int]]:
        """Propose ``max(limits)`` tokens per request, verify them, judge each row's first
        ``limits[i]``, cut both pools back; each request's new tokens (its kept proposals, then
        the target's next token). The requests' ``num_computed`` and ``draft_computed`` are
        updated; their tokens are left for the caller to append."""
        seqs, k = batch.seqs, max(limits)
        starts = [(seq.num_computed, seq.num_tokens, seq.draft_computed) for seq in seqs]
        try:
            clock = _StepClock(self.target.device)
            proposals, q = self._propose(seqs, k)
            clock.drafted()
            logits = self._verify(seqs, proposals, k)
            verdict = self._judge(seqs, proposals, q, logits, _on(logits.device, limits))
            runs = verdict.new_tokens()  # the step's one wait for the device
        except BaseException:
            self._undo(seqs, starts)
            raise
        drafting, verifying = clock.split()
        self.costs.record("draft", drafting / k)
        self.costs.record("verify", verifying)
        for seq, (computed, length, _), run, limit in zip(seqs, starts, runs, limits):
            kept = len(run) - 1
            seq.num_computed = computed + 1 + kept
            seq.draft_computed = min(seq.draft_computed, length + kept)
            self.target.kv_cache.truncate(seq.request_id, seq.num_computed)
            self.pool.truncate(seq.request_id, seq.draft_computed)
            if limit:
                seq.acceptance.observe(limit, kept)
        self.stats.count(limits, [len(run) - 1 for run in runs])
        self._since_measured += 1
        return runs

    def _propose(self, seqs: list[Sequence], k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` draft passes: the proposals ``[B, k]``, and the draft's distributions ``[B, k, V]``
        when any row samples (None when all are greedy). The host never waits for a pass: each
        pass's tokens feed the next on the device."""
        greedy = all(seq.params.greedy for seq in seqs)
        for seq in seqs:  # the slots the k passes write: what the draft lacks, then k - 1 proposals
            self._fed(seq, seq.num_tokens + k - 1)
        dists: list[torch.Tensor] = []
        drawn = [self._draw_pass(seqs, self._catch_up(seqs), greedy, dists)]
        for j in range(1, k):  # pass j feeds proposal j at position num_tokens - 1 + j
            step = self.draft.token_rows([(seq.request_id, seq.num_tokens - 1 + j, (0,)) for seq in seqs])
            drawn.append(self._draw_pass(seqs, self.draft.run_rows(step, drawn[-1]), greedy, dists))
        for seq in seqs:
            seq.draft_computed = seq.num_tokens + k - 1
        device = self.target.device
        return torch.stack(drawn, dim=1).to(device), (torch.stack(dists, dim=1).to(device) if dists else None)

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """The first draft pass, over what the draft lacks of each request: logits ``[B, V]``."""
        return self._feed([_View(seq.request_id, seq.token_ids, seq.draft_computed) for seq in seqs])

    def _draw_pass(self, seqs: list[Sequence], logits: torch.Tensor, greedy: bool, dists: list[torch.Tensor]) -> torch.Tensor:
        """One proposal per row ``[B]`` from a draft pass's logits; a sampling batch appends the
        draft's distributions to ``dists``."""
        if greedy:
            return logits.argmax(dim=-1)
        probs = self.sampler.probabilities(logits, [seq.params for seq in seqs])
        dists.append(probs)
        return torch.stack([self._draw(seq, row) for seq, row in zip(seqs, probs)])

    def _fed(self, seq: Sequence, tokens: int) -> None:
        """Grow the draft's pool to hold ``tokens`` of ``seq``."""
        if not self.pool.holds(seq.request_id):
            self.pool.allocate(seq.request_id, tokens)
        elif tokens > self.pool.num_tokens(seq.request_id):
            self.pool.extend(seq.request_id, tokens - self.pool.num_tokens(seq.request_id))

    @staticmethod
    def _draw(seq: Sequence, probs: torch.Tensor) -> torch.Tensor:
        if seq.params.greedy:
            return probs.argmax()
        return torch.multinomial(probs, 1, generator=seq.generator)[0]

    def _verify(self, seqs: list[Sequence], proposals: torch.Tensor, k: int) -> torch.Tensor:
        """The target over each request's last token and its proposals, a row each: logits
        ``[B, k + 1, V]``."""
        rows = []
        for seq in seqs:
            self.target.kv_cache.extend(seq.request_id, k)  # the step's own token is already in
            rows.append((seq.request_id, seq.num_computed, [seq.token_ids[-1]] + [0] * k))
        return self.target.run_rows(self.target.token_rows(rows), proposals).view(len(seqs), k + 1, -1)

    def _judge(self, seqs: list[Sequence], proposals: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor,
               limits: torch.Tensor) -> Verdict:  # fmt: skip
        k = proposals.shape[1]
        if q is None:
            return accept_greedy(proposals, logits, limits)
        params = [seq.params for seq in seqs for _ in range(k + 1)]
        p = self.sampler.probabilities(logits.reshape(len(seqs) * (k + 1), -1), params).view(len(seqs), k + 1, -1)
        greedy = torch.tensor([seq.params.greedy for seq in seqs], device=logits.device)
        sampled = accept_sampled(proposals, q, p, [seq.generator for seq in seqs], limits)
        if not greedy.any():
            return sampled
        exact = accept_greedy(proposals, logits, limits)  # greedy rows of a mixed batch
        return Verdict(torch.where(greedy, exact.accepted, sampled.accepted),
                       torch.where(greedy[:, None], exact.tokens, sampled.tokens))  # fmt: skip

    def rehearse(self, seqs: list[Sequence]) -> None:
        """A speculative step of ``seqs`` at full depth, its tokens thrown away: the draft's
        first pass over two rows per request and its ``k - 1`` further passes, the verify pass
        over ``k + 1`` rows per request, and the judging (profiling: its peak must include a
        step's). Every row writes slot 0 of block 0, so both pools must hold no request."""
        rows, k = len(seqs), self.k
        greedy = all(seq.params.greedy for seq in seqs)
        dists: list[torch.Tensor] = []
        drawn = [self._draw_pass(seqs, self.draft.run_rows(DecodeStep.dummy(2 * rows))[:rows], greedy, dists)]
        for _ in range(1, k):
            drawn.append(self._draw_pass(seqs, self.draft.run_rows(DecodeStep.dummy(rows), drawn[-1]), greedy, dists))
        proposals, q = torch.stack(drawn, dim=1), torch.stack(dists, dim=1) if dists else None
        logits = self.target.run_rows(DecodeStep.dummy(rows * (k + 1))).view(rows, k + 1, -1)
        self._judge(seqs, proposals, q, logits, torch.full((rows,), k, device=logits.device)).new_tokens()

    def _undo(self, seqs: list[Sequence], starts: list[tuple[int, int, int]]) -> None:
        """A step that raised: both pools back to what the requests held before it (the target's
        with this step's own token, as ``Scheduler.schedule`` left it)."""
        for seq, (computed, _, drafted) in zip(seqs, starts):
            seq.num_computed, seq.draft_computed = computed, drafted
            for pool, keep in ((self.target.kv_cache, computed + 1), (self.pool, drafted)):
                if pool.holds(seq.request_id) and pool.num_tokens(seq.request_id) > keep:
                    pool.truncate(seq.request_id, keep)


class _StepClock:
    """Where a speculative step's time goes: its wall time, split between the draft's passes and
    the verify pass (with the judging) in the proportion the device spent on each. On CUDA the
    host queues the passes without waiting, so the split is read from events; on the CPU every
    operation ends before the next starts, and the host's clock splits it."""

    def __init__(self, device: torch.device) -> None:
        self.started = time.perf_counter()
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if device.type == "cuda" else None
        self.drafted_at = self.started
        if self.events is not None:
            self.events[0].record()

    def drafted(self) -> None:
        self.drafted_at = time.perf_counter()
        if self.events is not None:
            self.events[1].record()

    def split(self) -> tuple[float, float]:
        """(seconds drafting, seconds verifying), once the step has waited for the device."""
        wall = time.perf_counter() - self.started
        if self.events is None:
            share = (self.drafted_at - self.started) / wall if wall > 0 else 0.0
        else:
            start, drafted, end = self.events
            end.record()
            end.synchronize()
            drafting, verifying = start.elapsed_time(drafted), drafted.elapsed_time(end)
            share = drafting / (drafting + verifying) if drafting + verifying > 0 else 0.0
        return wall * share, wall * (1 - share)


def _on(device: torch.device, values: list[int]) -> torch.Tensor:
    """A small int64 tensor on ``device`` without waiting for it: a plain ``.to("cuda")`` of a
    host tensor waits for the stream to drain, which would idle the device while the host
    prepares the next pass; from pinned memory the copy is queued like a kernel."""
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _history(seq: Sequence) -> History:
    return History(seq.token_ids, seq.num_prompt_tokens)
