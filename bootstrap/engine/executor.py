"""``PyExecutor``: the engine loop behind a thread-safe request API.

Callers ``enqueue`` token ids from any thread and get a request id back at once; a request that
can never run (empty, too long for ``max_seq_len``, larger than the KV pool, token ids outside
the vocabulary) is answered right away with an error instead of being queued. The worker thread
(``start_worker``) repeats one step: admit and schedule, run the model, sample, append, detect
stops, free what finished. When a step raises, its requests are run again one by one, and only
those that fail alone get the error on their response; the loop goes on. Without a worker, ``await_response``,
``stream`` and ``generate`` drive the steps in the calling thread, so nothing ever waits on a
loop that is not running.

``shutdown`` stops and joins the worker, answers every unfinished request with
``finish_reason="cancelled"`` and releases the KV pool and any captured CUDA graphs; it is
idempotent. A worker that does not stop in time does that itself when its step ends. Steps run under one lock, so a caller driving
the loop and a worker started meanwhile never step at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence as Seq
from dataclasses import dataclass, field

import anyio
import torch

from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.model_runner import ModelRunner
from bootstrap.engine.sampling import Sampler, SamplingParams, make_generator, model_eos_ids, stop_reason, trim_stop_text
from bootstrap.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from bootstrap.engine.sequence import Detokenizer, Response, Sequence, StreamEvent, next_request_id, token_id_list

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


@dataclass
class _Handle:
    seq: Sequence
    detokenizer: Detokenizer | None
    events: queue.Queue[StreamEvent] = field(default_factory=queue.Queue)
    done: threading.Event = field(default_factory=threading.Event)
    emitted: int = 0
    response: Response | None = None


class PyExecutor:
    """Scheduler, model runner and sampler wired into one loop; see the module docstring."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler,
                 tokenizer: object | None = None, eos_token_ids: set[int] | None = None) -> None:  # fmt: skip
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids is not None else model_eos_ids(runner.model)
        self._handles: dict[int, _Handle] = {}
        self._inbox: queue.Queue[Sequence | int | None] = queue.Queue()
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._closed = False

    # ---- requests -----------------------------------------------------------------------------

    def enqueue(
        self, prompt_token_ids: Seq[int], params: SamplingParams | None = None, *, is_warmup: bool = False
    ) -> int:
        """Queue a request; return its id. Impossible requests are answered at once with an error;
        arguments of the wrong type raise ``TypeError`` naming the argument."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        seq = Sequence(next_request_id(), token_id_list(prompt_token_ids), params, is_warmup=is_warmup)
        detok = None if is_warmup or self.tokenizer is None else Detokenizer(self.tokenizer)
        handle = _Handle(seq, detok)
        reason = self._rejection(seq)
        if reason is None:
            seq.generator = make_generator(params.seed, self.runner.device)
        with self._lock:
            if self._closed:
                raise RuntimeError("the executor is shut down; build a new one")
            self._handles[seq.request_id] = handle
            if reason is None:
                self._inbox.put(seq)
        if reason is not None:
            self._complete(handle, "error", f"request rejected: {reason}")
        return seq.request_id

    def _rejection(self, seq: Sequence) -> str | None:
        vocab = self.runner.vocab_size
        bad = [t for t in seq.prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            return f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}"
        if seq.params.stop and self.tokenizer is None and not seq.is_warmup:
            return "stop strings need a tokenizer, and this executor has none"
        return self.scheduler.capacity.rejection(seq)

    def cancel(self, request_id: int) -> None:
        """Finish a request early with ``finish_reason="cancelled"`` (no-op once finished)."""
        self._inbox.put(request_id)

    def await_response(self, request_id: int, timeout: float | None = None) -> Response:
        """Block until the request finishes; return its response (once: it is then forgotten)."""
        handle = self._handle(request_id)
        if not self._wait(handle, timeout):
            raise TimeoutError(f"request {request_id} did not finish within {timeout} s")
        self._forget(request_id)
        assert handle.response is not None
        return handle.response

    async def await_response_async(self, request_id: int, timeout: float | None = None) -> Response:
        """``await_response`` for async callers; the wait runs in a worker thread."""
        return await anyio.to_thread.run_sync(self.await_response, request_id, timeout, abandon_on_cancel=True)

    def stream(self, request_id: int) -> Iterator[StreamEvent]:
        """Yield one event per generated token; the last event carries ``finish_reason``."""
        handle = self._handle(request_id)
        while True:
            event = self._next_event(handle)
            yield event
            if event.finished:
                self._forget(request_id)
                return

    async def stream_async(self, request_id: int) -> AsyncIterator[StreamEvent]:
        """``stream`` for async callers; each wait runs in a worker thread."""
        handle = self._handle(request_id)
        while True:
            event = await anyio.to_thread.run_sync(self._next_event, handle, abandon_on_cancel=True)
            yield event
            if event.finished:
                self._forget(request_id)
                return

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Response]:
        """Run ``prompts`` (token id lists) to completion; one response per prompt, in order."""
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = [self.enqueue(p, sp) for p, sp in zip(prompts, per_prompt)]
        return [self.await_response(i) for i in ids]

    def run_warmup(self, num_tokens: int, num_requests: int = 1, max_tokens: int = 1) -> list[Response]:
        """Dummy requests (``is_warmup``) whose prompts add up to ``num_tokens`` tokens."""
        if not 1 <= num_requests <= num_tokens:
            raise ValueError(f"num_requests must be in [1, num_tokens={num_tokens}], got {num_requests}")
        sizes = [num_tokens // num_requests + (i < num_tokens % num_requests) for i in range(num_requests)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        vocab = self.runner.vocab_size
        ids = [self.enqueue([t % vocab for t in range(n)], params, is_warmup=True) for n in sizes]
        return [self.await_response(i) for i in ids]

    def _handle(self, request_id: int) -> _Handle:
        with self._lock:
            handle = self._handles.get(request_id)
        if handle is None:
            raise KeyError(f"unknown request id {request_id} (never enqueued, or its response was already taken)")
        return handle

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._handles.pop(request_id, None)

    def _wait(self, handle: _Handle, timeout: float | None) -> bool:
        """Wait for ``handle``, checking the worker every round: it may start, die or outlive a
        shutdown meanwhile, and while none runs this thread drives the loop itself."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not handle.done.is_set():
            left = _IDLE_WAIT_S if deadline is None else min(deadline - time.monotonic(), _IDLE_WAIT_S)
            if left <= 0:
                return False
            if self.worker_running:
                handle.done.wait(left)
            else:
                self._step_here()
        return True

    def _next_event(self, handle: _Handle) -> StreamEvent:
        """The next event of ``handle``, checking the worker every round as ``_wait`` does."""
        while True:
            while not self.worker_running and handle.events.empty():
                self._step_here()
            try:
                return handle.events.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                continue

    def _step_here(self) -> None:
        """One loop iteration in the calling thread, unless a worker runs the loop."""
        with self._step_lock:
            if self.worker_running:
                return
            self._drain_inbox(block=False)
            if self.scheduler.has_work:
                self.step()

    # ---- loop ---------------------------------------------------------------------------------

    @property
    def worker_running(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def start_worker(self) -> None:
        """Start the daemon worker thread running the loop (no-op if it is running)."""
        with self._lock:  # two callers at once still start one worker
            if self._closed:
                raise RuntimeError("the executor is shut down; build a new one")
            if not self.worker_running:
                self._worker = threading.Thread(target=self._loop, name="bootstrap-executor", daemon=True)
                self._worker.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._iterate()
        finally:  # also when shutdown() gave up waiting for this thread, or the thread died
            self._teardown(None if self._stop.is_set() else RuntimeError("the executor worker stopped unexpectedly"))

    def _iterate(self) -> None:
        """One worker round, under the step lock shared with callers that drive the loop."""
        with self._step_lock:
            try:
                self._drain_inbox(block=not self.scheduler.has_work)
                if not self._stop.is_set() and self.scheduler.has_work:
                    self.step()
            except Exception as exc:  # a bug outside the guarded step: fail what is queued, keep going
                log.exception("executor step failed outside the model step")
                self._fail(self.scheduler.drain(), exc)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                self._take(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _take(self, item: Sequence | int | None) -> None:
        if isinstance(item, Sequence):
            self.scheduler.add(item)
        elif isinstance(item, int):
            handle = self._handles.get(item)
            if handle is not None and not handle.done.is_set():
                self.scheduler.finish(handle.seq)
                self._complete(handle, "cancelled")

    def step(self) -> None:
        """Schedule, run, sample and update once.

        If the step raises, each of its requests is run again alone, so only the requests that
        fail by themselves get an error; the loop goes on either way.
        """
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return
        alone = len(batch.seqs) == 1
        if self._run(batch, fail=alone) or alone:
            return
        log.warning("a step of %d requests failed; running them one by one", len(batch.seqs))
        for part in batch.split():
            self._run(part, fail=True)

    def _run(self, batch: ScheduledBatch, fail: bool) -> bool:
        """Run one batch; on an exception fail its requests if ``fail``, and return False."""
        try:
            tokens = self._forward_and_sample(batch)
        except Exception as exc:
            if fail:
                log.exception("step of %d requests failed", len(batch.seqs))
                self._fail(batch.seqs, exc)
            return False
        self._update(batch, tokens)
        return True

    def _forward_and_sample(self, batch: ScheduledBatch) -> list[int]:
        logits = self.runner.run(batch)
        sampling = [s for s, samples in zip(batch.seqs, batch.samples()) if samples]
        if not sampling:
            return []
        params = [s.params for s in sampling]
        return self.sampler.sample(logits, params, [s.generator for s in sampling]).tolist()

    def _update(self, batch: ScheduledBatch, tokens: list[int]) -> None:
        sampled = iter(tokens)
        for seq, count, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples()):
            seq.num_computed += count
            if samples:
                try:
                    self._append(self._handles[seq.request_id], next(sampled))
                except Exception as exc:
                    log.exception("request %d failed after its step", seq.request_id)
                    self._fail([seq], exc)

    def _append(self, handle: _Handle, token: int) -> None:
        seq = handle.seq
        seq.append(token)
        if handle.detokenizer is not None:
            handle.detokenizer.add(token)
        text = handle.detokenizer.text if handle.detokenizer is not None else ""
        reason = stop_reason(seq.output_token_ids, text, seq.params, self.eos_token_ids)
        if reason is None:
            handle.events.put(StreamEvent(token, self._release_text(handle, text, final=False)))
            return
        self.scheduler.finish(seq)
        self._complete(handle, reason, token=token)

    def _release_text(self, handle: _Handle, text: str, final: bool) -> str:
        """New text safe to show: held back while it could still be the start of a stop string."""
        stops = handle.seq.params.stop
        visible = trim_stop_text(text, handle.seq.params) if final else text
        if stops and not final:
            visible = text[: max(len(text) - max(map(len, stops)) + 1, 0)]
        delta = visible[handle.emitted :]
        handle.emitted = max(handle.emitted, len(visible))
        return delta

    def _fail(self, seqs: list[Sequence], exc: BaseException) -> None:
        for seq in seqs:
            self.scheduler.finish(seq)
            handle = self._handles.get(seq.request_id)
            if handle is not None and not handle.done.is_set():
                self._complete(handle, "error", f"{type(exc).__name__}: {exc}")

    def _complete(self, handle: _Handle, reason: str, error: str | None = None, token: int | None = None) -> None:
        seq = handle.seq
        full = ""
        if handle.detokenizer is not None:
            try:
                handle.detokenizer.flush()
            except Exception as exc:  # the response must still be delivered, or its waiter hangs
                log.exception("request %d: detokenizing its last tokens failed", seq.request_id)
                reason, error = "error", error or f"{type(exc).__name__}: {exc}"
            full = handle.detokenizer.text
        seq.finish(reason, error)
        delta = self._release_text(handle, full, final=True)
        text = trim_stop_text(full, seq.params)
        handle.response = Response(
            seq.request_id, seq.prompt_token_ids, seq.output_token_ids, text, reason, error, seq.is_warmup
        )
        handle.events.put(StreamEvent(token, delta, reason, error))
        handle.done.set()

    # ---- teardown -----------------------------------------------------------------------------

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop and join the worker, cancel unfinished requests, release the KV pool (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._inbox.put(None)
        if self._worker is not None:
            self._worker.join(timeout)
            if self._worker.is_alive():
                raise RuntimeError(f"the executor worker did not stop within {timeout} s; it cancels "
                                   "what is unfinished and releases the KV pool when its step ends")
        self._teardown()

    def _teardown(self, died: BaseException | None = None) -> None:
        """Cancel every unfinished request and release the KV pool (idempotent); if the worker
        ``died``, fail its requests with that error instead and keep the pool for callers."""
        with self._step_lock:
            self._drain_inbox(block=False)
            if died is not None:
                return self._fail(self.scheduler.drain(), died)
            for seq in self.scheduler.drain():
                self._complete(self._handles[seq.request_id], "cancelled", "the executor was shut down")
            self.runner.release_graphs()
            self.runner.kv_cache.release()

    def __enter__(self) -> PyExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def create_executor(
    model: torch.nn.Module,
    kv_cache: PagedKVCache,
    config: SchedulerConfig,
    tokenizer: object | None = None,
    eos_token_ids: set[int] | None = None,
    start: bool = True,
    runner: ModelRunner | None = None,
) -> PyExecutor:
    """Wire a loaded model (switched to paged attention in place) and a KV pool into a
    ``PyExecutor``; its worker is started unless ``start=False``. ``runner``: one already made
    for this model and pool (with its CUDA graphs captured, say) instead of a new one."""
    if runner is None:
        runner = ModelRunner(model, kv_cache, config.max_batch_size, config.max_seq_len)
    elif runner.model is not model or runner.kv_cache is not kv_cache or runner.max_batch_size < config.max_batch_size:
        raise ValueError("the runner given to create_executor was made for another model, pool or batch size")
    executor = PyExecutor(runner, Scheduler(kv_cache, config), Sampler(runner.device), tokenizer, eos_token_ids)
    if start:
        executor.start_worker()
    return executor

