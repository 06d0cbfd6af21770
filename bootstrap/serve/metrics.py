"""Prometheus metrics of one app, in its own ``CollectorRegistry`` (never the global one).

Request figures are counted as requests end; bootstrap and engine figures (stage durations and
attempts, time to ready, KV blocks, queues) are read from the state at scrape time.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bootstrap.serve.state import Phase, ServeState

if TYPE_CHECKING:
    from bootstrap.engine.executor.channel.client import EngineClient  # zmq: with the first executor
    from bootstrap.engine.executor.stats import EngineStats
    from bootstrap.engine.spec.metrics import SpeculationStats
    from bootstrap.pipeline.events import StageStatus

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PHASES = get_args(Phase)  # every phase, the live operations' included


class ServeMetrics:
    def __init__(self, state: ServeState) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "bootstrap_requests",
            "Generation requests ended, by endpoint and finish_reason",
            ["endpoint", "finish_reason"],
            registry=registry,
        )
        self.ttft = Histogram(
            "bootstrap_time_to_first_token_seconds",
            "From enqueue to the first generated token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "bootstrap_request_latency_seconds",
            "From enqueue to the last token (stop or length)",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter("bootstrap_prompt_tokens", "Prompt tokens of ended requests", registry=registry)
        self.generated_tokens = Counter("bootstrap_generation_tokens", "Tokens generated", registry=registry)
        registry.register(StateCollector(state))


class StateCollector(Collector):
    """Figures read from the bootstrap and the executor each time ``/metrics`` is scraped."""

    def __init__(self, state: ServeState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        yield from self._bootstrap()
        if self.state.executor is not None and self.state.phase in ("ready", "shutting_down"):
            yield from self._engine(self.state.executor)

    def _bootstrap(self) -> Iterator[Metric]:
        state = self.state
        phase = GaugeMetricFamily("bootstrap_phase", "1 for the server's current phase", labels=["phase"])
        for name in PHASES:
            phase.add_metric([name], float(state.phase == name))
        yield phase
        duration = GaugeMetricFamily(
            "bootstrap_stage_duration_seconds", "Duration of each stage (so far, while it runs)", labels=["stage"]
        )
        attempts = GaugeMetricFamily("bootstrap_stage_attempts", "Attempts of each stage", labels=["stage"])
        for status in _statuses(state):
            duration.add_metric([status.stage], _duration(status))
            attempts.add_metric([status.stage], float(status.attempts))
        yield duration
        yield attempts
        if state.time_to_ready_s is not None:
            yield GaugeMetricFamily(
                "bootstrap_time_to_ready_seconds",
                "From the server start to a ready executor",
                value=state.time_to_ready_s,
            )
        yield GaugeMetricFamily(
            "bootstrap_requests_in_flight", "Requests the server is answering", value=float(len(state.inflight))
        )
        yield from _operations(state)

    def _engine(self, executor: EngineClient) -> Iterator[Metric]:
        stats = executor.engine_stats()  # the latest round's snapshot
        yield GaugeMetricFamily(
            "bootstrap_kv_capacity_blocks", "KV cache blocks in the pool", value=stats.kv_total_blocks
        )
        yield GaugeMetricFamily(
            "bootstrap_kv_capacity_tokens", "KV cache capacity in tokens", value=stats.kv_capacity_tokens
        )
        yield GaugeMetricFamily("bootstrap_kv_blocks_used", "KV cache blocks in use", value=stats.kv_used_blocks)
        yield GaugeMetricFamily("bootstrap_requests_running", "Requests the engine is running", value=stats.running)
        yield GaugeMetricFamily(
            "bootstrap_requests_waiting", "Requests queued in the engine, not yet admitted", value=stats.waiting
        )
        yield from _prefix_cache(stats)
        if executor.speculation is not None:
            yield from _speculation(executor.speculation)


def _prefix_cache(stats: EngineStats) -> Iterator[Metric]:
    """Prefix caching: whether it is on, cached blocks, and prompt tokens looked up and found
    (counted by the engine since it started: a swap, a weights update or a wake starts them again)."""
    yield GaugeMetricFamily(
        "bootstrap_prefix_caching", "1 when prefix caching is on", value=float(stats.prefix_caching)
    )
    yield GaugeMetricFamily(
        "bootstrap_kv_cached_blocks",
        "KV cache blocks holding a cached prefix, held or not",
        value=stats.kv_cached_blocks,
    )
    yield GaugeMetricFamily(
        "bootstrap_kv_cached_free_blocks",
        "Of the cached blocks, those no request holds (free capacity, reused on a hit)",
        value=stats.kv_cached_free_blocks,
    )
    yield CounterMetricFamily(
        "bootstrap_prefix_cache_query_tokens",
        "Prompt tokens looked up in the prefix cache",
        value=stats.prefix_query_tokens,
    )
    yield CounterMetricFamily(
        "bootstrap_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache (their KV not computed again)",
        value=stats.prefix_hit_tokens,
    )


def _speculation(stats: SpeculationStats) -> Iterator[Metric]:
    """Speculative decoding: draft tokens proposed and accepted, overall and by draft position."""
    yield GaugeMetricFamily(
        "bootstrap_spec_draft_tokens_proposed", "Draft tokens the target verified", value=stats.proposed
    )
    yield GaugeMetricFamily(
        "bootstrap_spec_draft_tokens_accepted", "Draft tokens the target kept", value=stats.accepted
    )
    rate = GaugeMetricFamily(
        "bootstrap_spec_acceptance_rate", "Draft tokens kept / proposed, by draft position", labels=["position"]
    )
    for position, (kept, proposed) in enumerate(zip(stats.accepted_at, stats.proposed_at)):
        rate.add_metric([str(position)], kept / proposed if proposed else 0.0)
    rate.add_metric(["all"], stats.acceptance_rate or 0.0)
    yield rate


def _operations(state: ServeState) -> Iterator[Metric]:
    """The live operations so far, by name and outcome, and their seconds (``bootstrap.api.operations``)."""
    records = state.boot.operations if state.boot is not None else []
    count = CounterMetricFamily(
        "bootstrap_operations", "Live operations by name and outcome", labels=["name", "outcome"]
    )
    seconds = CounterMetricFamily("bootstrap_operation_seconds", "Seconds spent in live operations", labels=["name"])
    for (name, outcome), n in Tally((r.name, r.outcome) for r in records).items():
        count.add_metric([name, outcome], float(n))
    for name in sorted({r.name for r in records}):
        seconds.add_metric([name], sum(r.duration_s or 0.0 for r in records if r.name == name))
    yield count
    yield seconds


def _statuses(state: ServeState) -> list[StageStatus]:
    return [] if state.boot is None else state.boot.stage_status()


def _duration(status: StageStatus) -> float:
    if status.duration_s is not None and status.state != "running":
        return float(status.duration_s)
    if status.started_at is not None and status.state == "running":
        return time.time() - status.started_at
    return 0.0
