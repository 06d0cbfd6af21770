"""``EngineLoop``: the loop behind ``PyExecutor``, its step, its rounds and its worker thread.

One step: admit and schedule, run the model, sample, append, detect stops, free what finished.
When a step raises, its requests are run again one by one, and only those that fail alone get
the error on their response; the loop goes on. A round takes what reached the inbox, finishes
what was given up (``cancel``, ``cancel_on_abandon``) and steps if there is work. The worker
thread (``start``) repeats rounds and sleeps on the inbox when idle; without it, the executor's
waits run rounds in the calling thread (``step_here``). Rounds run under one lock
(``step_lock``), so a caller and a worker never step at once. ``teardown`` cancels what is
unfinished and releases the KV pool and any CUDA graphs; a worker that does not stop in time
does that itself when its step ends; one that dies fails its requests with its error and
leaves the pool to callers driving the loop. Exit: a worker still running when the program ends
(no ``shutdown``) is shut down by an ``atexit`` hook (``_shutdown_at_exit``: registered by
``start``, removed by ``stop``); unfinished requests end ``cancelled``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable

import torch

from bootstrap.engine.executor.inbox import Inbox
from bootstrap.engine.executor.overlap import InFlight
from bootstrap.engine.executor.request_table import RequestTable
from bootstrap.engine.executor.responses import ResponseWriter
from bootstrap.engine.sampling.processing import History, logprob_tensors, uses_penalties
from bootstrap.engine.sampling.sampler import Sampler, generator_at
from bootstrap.engine.scheduler import Scheduler
from bootstrap.engine.spec.speculator import Speculator
from bootstrap.engine.step.batch import ScheduledBatch
from bootstrap.engine.step.decode_step import queued_tensor
from bootstrap.engine.step.model_runner import ModelRunner

log = logging.getLogger("bootstrap.engine.executor.py_executor")  # the executor's log: these are its steps

EXIT_TIMEOUT_S = 30.0  # how long the exit hook waits for a step to end


class EngineLoop:
    """Scheduler, model runner and sampler run in rounds for one executor's requests; see the
    module docstring."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        sampler: Sampler,
        requests: RequestTable,
        responses: ResponseWriter,
        speculator: Speculator | None = None,
    ) -> None:
        self.speculator = speculator  # a draft model's proposals, verified by the target (speculative decoding)
        self.runner = runner
        self.keep_pool = False  # set by stop(): the teardown leaves the pool and graphs to their owner
        self.scheduler = scheduler
        self.sampler = sampler
        self.requests = requests
        self.responses = responses
        responses.before_final = self._publish_load
        self.inbox = Inbox()
        self.step_lock = threading.Lock()
        self.load = (0, 0)  # (running, waiting) after the last round; replaced whole, read without a lock
        self.in_flight: InFlight | None = None  # the step launched and not read yet (overlap)
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._shutdown: Callable[[float | None], None] | None = None

    # ---- rounds in the calling thread ---------------------------------------------------------

    def step_here(self) -> bool:
        """One round in the calling thread, unless a worker runs the loop. False when there was
        nothing to do."""
        with self.step_lock, self.requests.wakes_batched():
            if self.requests.worker_live:
                return True
            took = self.inbox.drain_into(self.scheduler)
            self._cancel_given_up()
            if not self.scheduler.has_work:
                self.land()  # only finished requests can be left in it: their tokens are dropped
                self._publish_load()
                return took
            self.step()
            self._publish_load()
            return True

    def cancel_here(self) -> None:
        """Apply every pending cancellation in the calling thread, unless a worker runs the loop."""
        if not self.requests.worker_live:
            with self.step_lock:
                if not self.requests.worker_live:
                    self.inbox.drain_into(self.scheduler)
                    self._cancel_given_up()

    # ---- the worker ---------------------------------------------------------------------------

    def start(self, shutdown: Callable[[float | None], None]) -> None:
        """Start the daemon worker thread (no-op if it is running; the caller holds the request
        table's lock) and register the exit hook that calls ``shutdown`` (module docstring, Exit)."""
        if not self.requests.worker_live:
            self.requests.worker_live = True
            self.thread = threading.Thread(target=self._work, name="bootstrap-executor", daemon=True)
            self._shutdown = shutdown
            atexit.register(self._shutdown_at_exit)
            self.thread.start()

    def stop(self, timeout: float | None, keep_pool: bool = False) -> None:
        """Remove the exit hook, stop and join the worker (``keep_pool``: its teardown leaves
        the pool and graphs). Raises if it is still in a step after ``timeout`` s (it tears down
        itself when that step ends)."""
        self.keep_pool = keep_pool
        atexit.unregister(self._shutdown_at_exit)
        self._shutdown = None  # the executor's own method: a cycle that only a full collection would free
        self._stop.set()
        self.inbox.post(None)
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise RuntimeError(
                    f"the executor worker did not stop within {timeout} s; it cancels "
                    "what is unfinished and releases the KV pool when its step ends"
                )

    def _shutdown_at_exit(self) -> None:
        """The ``atexit`` hook of a live worker: shut down before the interpreter finalizes, when
        a daemon thread still inside a torch call is killed by ``pthread_exit`` as it retakes the
        GIL and the unwind through torch's C++ frames aborts the process ("terminate called
        without an active exception"). A worker stuck in a step costs one warning, not the exit."""
        shutdown = self._shutdown
        if shutdown is None:  # a stop() began meanwhile
            return
        try:
            shutdown(EXIT_TIMEOUT_S)
        except RuntimeError as exc:
            log.warning("at exit: %s", exc)

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                self._iterate()
        finally:  # also when shutdown() gave up waiting for this thread, or the thread died
            self.teardown(None if self._stop.is_set() else RuntimeError("the executor worker stopped unexpectedly"))
            self.requests.set_worker_live(False)  # waiters wake up and drive the loop themselves

    def _iterate(self) -> None:
        """One worker round: sleep on the inbox while there is no work (``enqueue`` and
        ``shutdown`` post to it; with no work there is nothing to cancel), then take what came,
        cancel what was given up and step, under the step lock shared with callers that drive
        the loop."""
        with self.step_lock:
            idle = not self.scheduler.has_work
            if idle:
                self.land()
        first = self.inbox.wait() if idle else None
        with self.step_lock, self.requests.wakes_batched():  # a round's async wakeups go out once, at its end
            try:
                self.inbox.drain_into(self.scheduler, first)
                self._cancel_given_up()
                if not self._stop.is_set() and self.scheduler.has_work:
                    self.step()
            except Exception as exc:  # a bug outside the guarded step: fail what is queued, keep going
                log.exception("executor step failed outside the model step")
                self.responses.fail(self.scheduler.drain(), exc)
            self._publish_load()

    def _publish_load(self) -> None:
        """Record the scheduler's request counts for ``engine_stats``: after each round and before
        an answer wakes its waiter (``ResponseWriter.before_final``)."""
        self.load = (len(self.scheduler.running), len(self.scheduler.waiting))

    def _cancel_given_up(self) -> None:
        """Finish the requests given up since the last round (``cancel``, ``cancel_on_abandon``)."""
        for handle in self.requests.pop_cancelled():
            if not handle.finished:
                self.scheduler.finish(handle.seq)
                self.responses.complete(handle, "cancelled")

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> None:
        """Schedule, run, sample and update once.

        With overlap (``SchedulerConfig.overlap``, on a runner of its own rank and no draft) the
        step is launched before the tokens of the step before are read (``overlap.InFlight``);
        a step whose requests need those tokens on the host (penalties) reads them first. If the
        step raises, each of its requests is run again alone, so only the requests that fail by
        themselves get an error; the loop goes on either way.
        """
        batch = self.scheduler.schedule()
        if batch.seqs and self._overlaps(batch):
            return self._launch(batch)
        self.land()
        batch = batch.without_finished()
        if not batch.seqs:
            return
        limits = self.speculator.plan(batch) if self.speculator is not None else None
        if limits is not None and self._speculate(batch, limits):
            return
        alone = len(batch.seqs) == 1
        started = time.perf_counter()
        if self._run(batch, fail=alone) or alone:
            if self.speculator is not None:
                self.speculator.ordinary(batch, time.perf_counter() - started)
            return
        self._one_by_one(batch)

    def _one_by_one(self, batch: ScheduledBatch) -> None:
        log.warning("a step of %d requests failed; running them one by one", len(batch.seqs))
        for part in batch.split():
            self._run(part, fail=True)

    @property
    def overlap_on(self) -> bool:
        """Overlap is asked for, the runner leads no other rank and no draft speculates."""
        return self.scheduler.config.overlap and self.speculator is None and self.runner.lockstep is None

    def _overlaps(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch`` launches before the step in flight is read: overlap is on and no
        request samples from a history in flight."""
        return self.overlap_on and not any(s.in_flight and uses_penalties(s.params) for s in batch.seqs)

    def _launch(self, batch: ScheduledBatch) -> None:
        """Run ``batch`` fed from the step in flight, queue its sampling, then read that step."""
        before = self.in_flight
        try:
            logits = self.runner.run(batch, before.feed(batch) if before is not None else None)
            forked = self.scheduler.fork(batch)  # after the forward: the prompts' KV is complete
            launched = self._sample(forked, logits)
        except Exception as exc:
            self.land()
            batch = batch.without_finished()
            if len(batch.seqs) > 1:
                return self._one_by_one(batch)
            log.exception("step of %d requests failed", len(batch.seqs))
            return self.responses.fail(batch.seqs, exc)
        for seq, count in zip(forked.seqs, forked.num_new_tokens):
            seq.num_computed += count
        for seq in launched.seqs:
            seq.in_flight += 1
        self.in_flight = launched
        if before is not None:
            self._read(before)

    def land(self) -> None:
        """Read the step in flight, if any: its requests get their tokens."""
        if self.in_flight is not None:
            flight, self.in_flight = self.in_flight, None
            self._read(flight)

    def _read(self, flight: InFlight) -> None:
        try:
            tokens, logprobs = flight.read()
        except Exception as exc:
            log.exception("reading a step's tokens failed")
            for seq in flight.seqs:
                seq.in_flight = 0
            return self.responses.fail([s for s in flight.seqs if not s.finished], exc)
        self.responses.land(flight.seqs, tokens, logprobs)

    def _run(self, batch: ScheduledBatch, fail: bool) -> bool:
        """Run one batch and read its tokens; on an exception fail its requests (and forks
        joined to it) if ``fail``, and return False."""
        try:
            logits = self.runner.run(batch)
            if self.speculator is not None:
                self.speculator.mirror(batch)  # the draft computes the same tokens, before any fork
            batch = self.scheduler.fork(batch)  # after the forward: the prompts' KV is complete
            tokens, logprobs = self._sample(batch, logits).read()
        except Exception as exc:
            if fail:
                log.exception("step of %d requests failed", len(batch.seqs))
                self.responses.fail(batch.seqs, exc)
            return False
        self.responses.record(batch, tokens, logprobs)
        return True

    def _speculate(self, batch: ScheduledBatch, limits: list[int]) -> bool:
        """A speculative step, ``limits[i]`` draft tokens judged for request ``i``; False (pools
        as they were) when it raised, so the step runs as an ordinary one."""
        try:
            runs = self.speculator.step(batch, limits)
        except Exception:
            log.exception("a speculative step of %d requests failed; running it without the draft", len(batch.seqs))
            return False
        self.responses.record_runs(batch, runs)
        return True

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> InFlight:
        """Queue the sampling of the requests that sample now (a fork from its parent's logits
        row), and the copies of their tokens and logprobs to the host."""
        sampling = [s for s, samples in zip(batch.seqs, batch.samples()) if samples]
        if not sampling:
            return InFlight.launch([], torch.empty(0, dtype=torch.long, device=logits.device), ())
        if batch.rows is not None:
            logits = logits.index_select(0, queued_tensor(logits.device, batch.rows))
        params = [s.params for s in sampling]
        histories = [History(s.token_ids, s.num_prompt_tokens, s.in_flight) for s in sampling]
        generators = [generator_at(s.generator, s.params.seed, s.num_generated) for s in sampling]
        tokens = self.sampler.sample(logits, params, generators, histories, self.responses.eos_token_ids)
        return InFlight.launch(sampling, tokens, logprob_tensors(logits, tokens, params))

    # ---- teardown -----------------------------------------------------------------------------

    def teardown(self, died: BaseException | None = None) -> None:
        """Cancel every unfinished request and release the KV pool and graphs (idempotent; kept
        when ``keep_pool`` is set); if the worker ``died``, fail its requests with that error
        instead and keep the pool for callers."""
        with self.step_lock:
            self.in_flight = None  # its requests end below; the device finishes it before the pool is reused
            self.inbox.drain_into(self.scheduler)
            if died is not None:
                return self.responses.fail(self.scheduler.drain(), died)
            for seq in self.scheduler.drain():
                self.responses.complete(self.responses.handle_of(seq), "cancelled", "the executor was shut down")
            if not self.keep_pool:
                self.runner.release_graphs()
                self.runner.kv_cache.release()
            self._publish_load()
