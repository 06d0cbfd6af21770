"""``ResponseWriter``: what a step's sampled tokens become for the callers waiting on them.

After each step the executor hands it the batch and its tokens (``record``): every request
advances by the tokens it computed, and one that sampled gets its token appended, is checked for
a stop (EOS, ``max_tokens``, a stop string) and publishes a stream event with the text safe to
show (held back while it could still be the start of a stop string). A finished request gets its
``Response`` (``complete``); a failed one an error response (``fail``). The scheduler frees what
finished; ``bootstrap.engine.executor.request_table`` holds the events and responses until they are taken.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

from bootstrap.engine.executor.request_table import Handle, RequestTable
from bootstrap.engine.request.sequence import Response, Sequence, StreamEvent
from bootstrap.engine.sampling.processing import TokenLogprob
from bootstrap.engine.sampling.sampler import stop_reason, trim_stop_text
from bootstrap.engine.scheduler import Scheduler
from bootstrap.engine.step.batch import ScheduledBatch

log = logging.getLogger("bootstrap.engine.executor.py_executor")  # the executor's log: these are its steps


class ResponseWriter:
    """Sampled tokens to stream events and responses, for one executor's requests."""

    def __init__(self, requests: RequestTable, scheduler: Scheduler, eos_token_ids: set[int]) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.before_final: Callable[[], None] = lambda: None  # the loop's load, published before a waiter wakes

    def record(
        self, batch: ScheduledBatch, tokens: list[int], logprobs: Seq[TokenLogprob | None] | None = None
    ) -> None:
        """After a step: advance every request of ``batch``, append each sampled token (and its
        logprobs, when asked) in order. A request that fails here (a tokenizer error, say) gets
        an error; the others go on."""
        sampled = iter(tokens)
        entries = iter(logprobs if logprobs is not None else [None] * len(tokens))
        for seq, count, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples()):
            seq.num_computed += count
            if samples:
                try:
                    self.append(self.handle_of(seq), next(sampled), next(entries))
                except Exception as exc:
                    log.exception("request %d failed after its step", seq.request_id)
                    self.fail([seq], exc)

    def land(self, seqs: Seq[Sequence], tokens: list[int], logprobs: Seq[TokenLogprob | None]) -> None:
        """After an overlapped step is read (``num_computed`` advanced at its launch): append each
        request's token, unless it finished meanwhile (a stop read one step before, a cancel)."""
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            seq.in_flight = max(seq.in_flight - 1, 0)
            if seq.finished:
                seq.in_flight = 0
                continue
            try:
                self.append(self.handle_of(seq), token, logprob)
            except Exception as exc:
                log.exception("request %d failed after its step", seq.request_id)
                self.fail([seq], exc)

    def record_runs(self, batch: ScheduledBatch, runs: Seq[list[int]]) -> None:
        """After a speculative step (``num_computed`` already advanced): append each request's new
        tokens in order until one finishes it (a stop, EOS or ``max_tokens`` inside the run: the
        rest are dropped with its blocks)."""
        for seq, run in zip(batch.seqs, runs):
            try:
                handle = self.handle_of(seq)
                for token in run:
                    self.append(handle, token)
                    if seq.finished:
                        break
            except Exception as exc:
                log.exception("request %d failed after its step", seq.request_id)
                self.fail([seq], exc)

    def handle_of(self, seq: Sequence) -> Handle:
        handle = self.requests.get(seq.request_id)
        if handle is None:
            raise RuntimeError(f"request {seq.request_id} runs but has no handle")
        return handle

    def append(self, handle: Handle, token: int, logprob: TokenLogprob | None = None) -> None:
        seq = handle.seq
        seq.clock.sampled()
        seq.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        start = None  # where the token's text starts in the whole text (with a tokenizer)
        if handle.detokenizer is not None:
            start = len(handle.detokenizer.text)
            if len(seq.output_token_ids) <= seq.params.min_tokens:  # stop strings count from here on
                seq.stop_from = start
            handle.detokenizer.add(token)
        text = handle.detokenizer.text if handle.detokenizer is not None else ""
        reason = stop_reason(seq.output_token_ids, text, seq.params, self.eos_token_ids, seq.stop_from)
        if reason is None:
            event = StreamEvent(token, _release_text(handle, text, final=False), **_logprob_fields(logprob, start))
            self.requests.publish(handle, event)
            return
        self.scheduler.finish(seq)
        self.complete(handle, reason, token=token, logprob=logprob, text_offset=start)

    def fail(self, seqs: Iterable[Sequence], exc: BaseException) -> None:
        for seq in seqs:
            self.scheduler.finish(seq)
            handle = self.requests.get(seq.request_id)
            if handle is not None and not handle.finished:
                self.complete(handle, "error", f"{type(exc).__name__}: {exc}")

    def complete(
        self,
        handle: Handle,
        reason: str,
        error: str | None = None,
        token: int | None = None,
        logprob: TokenLogprob | None = None,
        text_offset: int | None = None,
    ) -> None:
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
        delta = _release_text(handle, full, final=True)
        text = trim_stop_text(full, seq.params, seq.stop_from)
        logprobs = list(seq.logprobs) if seq.params.logprobs is not None else None
        timing = seq.clock.timing()
        response = Response(
            seq.request_id,
            seq.prompt_token_ids,
            seq.output_token_ids,
            text,
            reason,
            error,
            seq.is_warmup,
            logprobs,
            timing,
            seq.cached_tokens,
        )
        final = StreamEvent(
            token,
            delta,
            reason,
            error,
            **_logprob_fields(logprob, text_offset),
            timing=timing,
            cached_tokens=seq.cached_tokens,
        )
        self.before_final()  # a caller that reads engine_stats after its answer finds itself gone
        self.requests.publish(handle, final, response)


def _logprob_fields(entry: TokenLogprob | None, text_offset: int | None) -> dict:
    """The stream event's logprob fields for one token's ``TokenLogprob`` and where its text
    starts (empty when not asked)."""
    return {} if entry is None else {"logprob": entry.logprob, "top_logprobs": entry.top, "text_offset": text_offset}


def _release_text(handle: Handle, text: str, final: bool) -> str:
    """New text safe to show: held back while it could still be the start of a stop string."""
    stops = handle.seq.params.stop
    visible = trim_stop_text(text, handle.seq.params, handle.seq.stop_from) if final else text
    if stops and not final:
        visible = text[: max(len(text) - max(map(len, stops)) + 1, 0)]
    delta = visible[handle.emitted :]
    handle.emitted = max(handle.emitted, len(visible))
    return delta
