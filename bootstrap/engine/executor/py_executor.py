"""``PyExecutor``: the engine loop behind a thread-safe request API; what callers rely on.

Callers ``enqueue`` token ids from any thread and get a request id back at once; a request that
can never run (empty, too long for ``max_seq_len``, larger than the KV pool, token ids outside
the vocabulary) is answered at once with an error instead of being queued. The loop (its step,
errors, worker thread and exit hook: ``executor.loop``) runs on a worker (``start_worker``) or,
without one, inside the calls that wait (``executor.waiting``). ``await_response`` / ``stream``
(threads) and ``await_response_async`` / ``stream_async`` (anyio tasks) wait on wakeups, never by
polling, one wait at a time per request (a second raises ``RequestInUse``); a wait that is
cancelled or times out takes nothing, unless ``cancel_on_abandon=True`` gives the request up.
Retention (``executor.request_table``): a request is held until its response is taken; ``cancel``
releases it once finished; the ``max_unclaimed`` most recent unclaimed responses are kept; a
released id raises ``KeyError``. ``shutdown`` (idempotent) answers unfinished requests
``finish_reason="cancelled"``, wakes every waiter and releases the KV pool and any CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import anyio

from bootstrap.config import is_int
from bootstrap.engine.executor.loop import EngineLoop
from bootstrap.engine.executor.request_table import Claim, Handle, Outbox, RequestStats, RequestTable, Route
from bootstrap.engine.executor.responses import ResponseWriter
from bootstrap.engine.executor.stats import EngineStats
from bootstrap.engine.executor.waiting import EventStream, Waiter
from bootstrap.engine.request.prompts import MAX_CHOICES, token_id_problem
from bootstrap.engine.request.sequence import (
    Detokenizer,
    Response,
    Sequence,
    StreamEvent,
    next_request_id,
    token_id_list,
)
from bootstrap.engine.request.stream_event import REJECTED
from bootstrap.engine.sampling.sampler import MAX_SEED, Sampler, SamplingParams, make_generator, model_eos_ids
from bootstrap.engine.scheduler import Scheduler
from bootstrap.engine.spec.speculator import Speculator
from bootstrap.engine.step.model_runner import ModelRunner

DEFAULT_MAX_UNCLAIMED = 1024


class PyExecutor:
    """Scheduler, model runner and sampler wired into one loop; see the module docstring."""

    shuts_down_at_exit = (
        True  # its worker's atexit hook (bootstrap.engine.executor.loop, Exit): none needed from bootstrap.api
    )

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        sampler: Sampler,
        tokenizer: object | None = None,
        eos_token_ids: set[int] | None = None,
        max_unclaimed: int = DEFAULT_MAX_UNCLAIMED,
        speculator: Speculator | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids is not None else model_eos_ids(runner.model)
        self._requests = RequestTable(max_unclaimed)
        self._responses = ResponseWriter(self._requests, scheduler, self.eos_token_ids)
        self.speculator = speculator  # the draft model and its statistics, when it speculates
        self._loop = EngineLoop(runner, scheduler, sampler, self._requests, self._responses, speculator)
        self._waiter = Waiter(self._requests, self._loop.step_here)
        self._lock = self._requests.lock  # also guards _closed and the worker's start
        self._closed = False

    # ---- requests -----------------------------------------------------------------------------

    def enqueue(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        *,
        is_warmup: bool = False,
        cache_salt: str | None = None,
    ) -> int:
        """Queue a request; return its id. Impossible requests are answered at once with an error;
        arguments of the wrong type raise ``TypeError`` naming the argument. ``cache_salt``: with
        prefix caching, the request shares cached blocks only with requests of the same salt."""
        self._check_open()
        [handle] = self._submit([self._sequence(prompt_token_ids, params, is_warmup, cache_salt)])
        return handle.request_id

    def enqueue_choices(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        n: int = 1,
        *,
        cache_salt: str | None = None,
        outbox: Outbox | None = None,
        keys: Seq[int] = (),
    ) -> list[int]:
        """Queue ``n`` choices (1 to ``MAX_CHOICES``) of one prompt; their ids, one request each.
        The prompt is prefilled once and its KV blocks shared (``bootstrap.engine.scheduler``).
        With a seed, choice ``i`` samples with ``seed + i`` (wrapping past ``MAX_SEED``), so
        choice 0 is what ``enqueue`` gives. All are answered the same way when impossible.
        ``outbox``: the choices are routed (``request_table.Route``): their events go to it as
        (``keys[i]``, event) pairs, a round's in one call, and none waits here to be taken."""
        self._check_open()
        if not is_int(n) or not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
        if outbox is not None and len(keys) != n:
            raise ValueError(f"keys must name each of the n={n} choices, got {len(keys)}")
        first = self._sequence(prompt_token_ids, params, cache_salt=cache_salt)
        first.forks = [
            self._sequence(first.prompt_token_ids, _choice_params(first.params, i), cache_salt=cache_salt)
            for i in range(1, n)
        ]
        routes = [Route(outbox, key) for key in keys] if outbox is not None else None
        return [h.request_id for h in self._submit([first, *first.forks], routes=routes)]

    def cancel(self, request_id: int, *, keep_response: bool = False) -> None:
        """Give the request up: an unfinished one finishes with ``finish_reason="cancelled"``. It
        is released (its id becomes unknown) once finished and no wait is attached; an attached
        wait still gets its end. With ``keep_response`` it is cancelled but kept: its response
        (how far it got, its timing) waits to be taken like any finished one. Unknown ids are
        ignored. Without a worker, the cancellation is applied here, so the request's KV blocks
        are free when this returns."""
        if not isinstance(keep_response, bool):
            raise TypeError(f"keep_response must be a bool, got {type(keep_response).__name__}")
        self._requests.give_up(request_id, keep_response)
        self._loop.cancel_here()

    def stats(self) -> RequestStats:
        """How many requests the executor holds: all, unfinished, unclaimed, with a wait attached."""
        return self._requests.stats()

    def engine_stats(self) -> EngineStats:
        """KV blocks in use and requests running and waiting; safe from any thread and never
        waits for a step: the KV figures are the pool's own snapshot, the request counts those
        of the last loop round (plus what is still in the inbox)."""
        kv = self.runner.kv_cache.stats()
        running, waiting = self._loop.load
        spec = self.speculator.stats if self.speculator is not None else None
        return EngineStats(
            kv.total_blocks,
            kv.used_blocks,
            kv.capacity_tokens,
            running,
            waiting + self._loop.inbox.pending(),
            spec.proposed if spec else 0,
            spec.accepted if spec else 0,
            self.scheduler.config.prefix_caching,
            kv.cached_blocks,
            kv.cached_free_blocks,
            self.scheduler.prefix_query_tokens,
            self.scheduler.prefix_hit_tokens,
            "fp8" if self.runner.kv_cache.quantized else str(self.runner.kv_cache.spec.dtype).removeprefix("torch."),
            self._loop.overlap_on,
        )

    @property
    def is_running(self) -> bool:
        """True until ``shutdown``: the executor takes requests."""
        return not self._closed

    def await_response(
        self, request_id: int, timeout: float | None = None, *, cancel_on_abandon: bool = False
    ) -> Response:
        """Block until the request finishes; return its response (once: it is then released).
        ``TimeoutError`` after ``timeout`` s leaves it for a later wait, unless ``cancel_on_abandon``."""
        claim = self._requests.attach(request_id, "await_response")
        response = None
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            response = self._waiter.wait(claim.handle, self._requests.take_response, deadline)
            if response is None:
                raise TimeoutError(f"request {request_id} did not finish within {timeout} s")
            return response
        finally:
            self._requests.detach(claim.handle, claim, give_up=cancel_on_abandon and response is None)

    # ASYNC109: the sync await_response's signature, its timeout (TimeoutError) included, for async callers
    async def await_response_async(
        self,
        request_id: int,
        timeout: float | None = None,  # noqa: ASYNC109
        *,
        cancel_on_abandon: bool = False,
    ) -> Response:
        """``await_response`` for async callers; cancelling the awaiting task is like a timeout."""
        claim = self._requests.attach(request_id, "await_response_async")
        response = None
        try:
            with anyio.move_on_after(timeout):
                response = await self._waiter.wait_async(claim.handle, self._requests.take_response)
            if response is None:
                raise TimeoutError(f"request {request_id} did not finish within {timeout} s")
            return response
        finally:
            self._requests.detach(claim.handle, claim, give_up=cancel_on_abandon and response is None)

    def stream(self, request_id: int, *, cancel_on_abandon: bool = False) -> Iterator[StreamEvent]:
        """Yield one event per generated token; the last event carries ``finish_reason``. Closing
        the stream early leaves the rest for a later one, unless ``cancel_on_abandon``."""
        claim = self._requests.attach(request_id, "stream")
        finished = False
        try:
            while not finished:
                event = self._waiter.wait(claim.handle, self._requests.take_event, None)
                assert event is not None  # no deadline
                finished = event.finished
                yield event
        finally:
            self._requests.detach(claim.handle, claim, give_up=cancel_on_abandon and not finished)

    def stream_async(self, request_id: int, *, cancel_on_abandon: bool = False) -> EventStream:
        """``stream`` for async callers. A cancelled wait for the next event takes nothing and
        ends this iterator (it lets go of the request at once, even unclosed)."""
        return EventStream(self._waiter, request_id, cancel_on_abandon)

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[Response]:
        """Run ``prompts`` (token id lists) to completion; one response per prompt, in order.
        Every prompt is checked before any is queued."""
        self._check_open()
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        return self._run_all([self._sequence(p, sp) for p, sp in zip(prompts, per_prompt)])

    def run_warmup(self, num_tokens: int, num_requests: int = 1, max_tokens: int = 1) -> list[Response]:
        """Dummy requests (``is_warmup``) whose prompts add up to ``num_tokens`` tokens."""
        self._check_open()
        if not 1 <= num_requests <= num_tokens:
            raise ValueError(f"num_requests must be in [1, num_tokens={num_tokens}], got {num_requests}")
        sizes = [num_tokens // num_requests + (i < num_tokens % num_requests) for i in range(num_requests)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        vocab = self.runner.vocab_size
        return self._run_all([self._sequence([t % vocab for t in range(n)], params, True) for n in sizes])

    # ---- submitting ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the executor is shut down; build a new one")

    def _sequence(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None,
        is_warmup: bool = False,
        cache_salt: str | None = None,
    ) -> Sequence:
        """A checked, not yet queued request (``TypeError`` for arguments of the wrong type)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_cache_salt(cache_salt)
        tokens = token_id_list(prompt_token_ids)
        return Sequence(next_request_id(), tokens, params, is_warmup=is_warmup, cache_salt=cache_salt)

    def _submit(
        self, seqs: list[Sequence], claim: Claim | None = None, routes: list[Route] | None = None
    ) -> list[Handle]:
        """Register and queue ``seqs`` all at once (held by ``claim``, or routed, if given);
        answer those that can never run with an error."""
        detok = lambda s: None if s.is_warmup or self.tokenizer is None else Detokenizer(self.tokenizer)  # noqa: E731
        handles = [self._requests.new_handle(s, detok(s)) for s in seqs]
        for handle, route in zip(handles, routes or ()):
            handle.route, claim = route, claim or Claim("outbox")
        carrier = {c.request_id: s for s in seqs for c in s.forks}  # forks are queued with the request carrying them
        roots = {s.request_id: self._rejection(s) for s in seqs if s.request_id not in carrier}
        reasons = [roots[carrier.get(s.request_id, s).request_id] for s in seqs]
        for seq, reason in zip(seqs, reasons):
            if reason is None:
                seq.generator = make_generator(seq.params.seed, self.runner.device)
        with self._lock:
            self._check_open()
            self._requests.add(handles, claim)
            for handle, reason in zip(handles, reasons):
                if reason is None and handle.request_id not in carrier:
                    self._loop.inbox.post(handle.seq)
        for handle, reason in zip(handles, reasons):
            if reason is not None:
                self._responses.complete(handle, "error", f"{REJECTED}{reason}")
        return handles

    def _rejection(self, seq: Sequence) -> str | None:
        problem = token_id_problem(seq.prompt_token_ids, self.runner.vocab_size)
        if problem is not None:
            return problem
        if seq.params.stop and self.tokenizer is None and not seq.is_warmup:
            return "stop strings need a tokenizer, and this executor has none"
        return self.scheduler.rejection(seq)

    def _run_all(self, seqs: list[Sequence]) -> list[Response]:
        """Submit ``seqs`` and wait for every response; on any exit without them, cancel the rest."""
        claim = Claim("generate")
        handles = self._submit(seqs, claim)
        try:
            return [self._waiter.wait(h, self._requests.take_response, None) for h in handles]  # type: ignore[misc]
        finally:
            for handle in handles:
                self._requests.detach(handle, claim, give_up=True)

    # ---- loop (bootstrap.engine.executor.loop) ---------------------------------------------------------

    @property
    def worker_running(self) -> bool:
        """True while a worker thread runs the loop (from ``start_worker`` until it ends)."""
        return self._requests.worker_live

    @property
    def _worker(self) -> threading.Thread | None:
        """The worker thread, once started (it may have ended since)."""
        return self._loop.thread

    def start_worker(self) -> None:
        """Start the daemon worker thread running the loop (no-op if it is running)."""
        with self._lock:  # two callers at once still start one worker
            self._check_open()
            self._loop.start(self.shutdown)

    def step(self) -> None:
        """Schedule, run, sample and update once (``EngineLoop.step``): if the step raises, each
        of its requests is run again alone, so only the requests that fail by themselves get an
        error."""
        self._loop.step()

    # ---- teardown -----------------------------------------------------------------------------

    def shutdown(self, timeout: float | None = 30.0, *, keep_pool: bool = False) -> None:
        """Stop and join the worker, cancel unfinished requests (waking their waiters), release
        the KV pool and the runner's CUDA graphs (idempotent); ``keep_pool``: both stay, every
        block freed, for their owner (a pipeline's stages) and a next executor on them. Raises
        if the worker is still in a step after ``timeout`` s."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._loop.stop(timeout, keep_pool)
        self._loop.teardown()

    def __enter__(self) -> PyExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s params: its own seed (``seed + index``), if seeded."""
    return params if params.seed is None else dataclasses.replace(params, seed=(params.seed + index) % (MAX_SEED + 1))


MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(salt: object) -> None:
    """``cache_salt``: None or a string of 1 to ``MAX_CACHE_SALT_CHARS`` characters."""
    if salt is None:
        return
    if not isinstance(salt, str):
        raise TypeError(f"cache_salt must be a string, got {type(salt).__name__}")
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
