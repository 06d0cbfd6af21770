"""For ``auto`` (``--num-speculative-tokens auto``) each request keeps its recent acceptance
(``request.acceptance``) and speculates as deep as ``best_depth`` says pays off for it, given what the
passes are measured to cost (``StepCosts``), down to not at all."""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 16  # steps a request that stopped speculating waits before it tries one proposal again
REMEASURE_EVERY = 32  # auto: speculative steps between two timed decode steps (one step in 33 not speculating)
ROW_TOKENS = PROBE_EVERY + 2  # the most a request lags the draft by (a paused request's steps, then a step's two)


@dataclass
class StepCosts:
    """``auto``: what an ordinary decode step, a verify pass and one draft pass take, in seconds,
    as measured (decayed averages). Before its first measurement a verify pass counts as a decode
    step and a draft pass as ``prior`` of one (the draft's weight bytes over the target's: decode
    reads every weight once)."""

    prior: float
    decode: float | None = None
    verify: float | None = None
    draft: float | None = None

    def record(self, what: str, seconds: float) -> None:
        """One measurement of ``decode``, ``verify`` or ``draft`` (per pass). The decode and draft
        figures fall at once to a lower measurement and rise by the decay: a step that carried a
        one-time cost (the first after the start, a first use) must not make speculating look
        worth it, or not worth it, for the many steps a decay would take to forget it; a draft
        figure too high would stop speculating for good, since only speculative steps measure
        it. The verify figure moves by the decay only: a verify pass measured below a decode step
        would make proposals that are never kept look worth their draft pass."""
        old = getattr(self, what)
        if old is None or (what != "verify" and seconds < old):
            setattr(self, what, seconds)
        else:
            setattr(self, what, COST_DECAY * old + (1 - COST_DECAY) * seconds)

    def of(self) -> tuple[float, float, float]:
        """(decode, verify, draft): the measured seconds, the prior standing in for a pass not
        measured yet; all of the prior (in decode steps) until a decode step is measured, the
        scale every other figure is weighed against."""
        if self.decode is None:
            return 1.0, 1.0, self.prior
        verify = self.verify if self.verify is not None else self.decode
        return self.decode, verify, self.draft if self.draft is not None else self.prior * self.decode


COST_DECAY = 0.7


def expected_tokens(rate: float, k: int) -> float:
    """The tokens a step of depth ``k`` gives on average when each proposal is kept with
    probability ``rate``: the kept run, then the target's own token."""
    return k + 1.0 if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def best_depth(rate: float, costs: StepCosts, ceiling: int) -> int:
    """The depth that gives the most tokens per second: decoding alone gives one token a decode
    step; a step of depth ``k`` gives ``(1 - rate^(k+1)) / (1 - rate)`` on average and costs a
    verify pass and ``k`` draft passes. 0 when no depth beats decoding alone; a deeper one must
    beat the best so far by more than ``1e-9`` (a tie goes to the shallower). It runs for every
    request of every step (twice: ``plan`` and ``keeps_up``), so it is one loop that builds the
    sum as it goes, measured faster than the closed form for each depth in turn
    (benchmarks/README.md, Speculative decoding)."""
    decode, verify, draft = costs.of()
    best, best_value = 0, 1.0  # in tokens per decode step's time: decoding alone
    tokens, power = 1.0, 1.0
    for k in range(1, ceiling + 1):
        power *= rate
        tokens += power  # expected_tokens(rate, k)
        value = tokens * decode / (verify + draft * k)
        if value > best_value + 1e-9:
            best, best_value = k, value
    return best
