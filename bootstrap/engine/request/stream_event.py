"""``StreamEvent``: one streamed step of a request, as the engine publishes it and the server
reads it; torch-free, so the server's side of the channel (``bootstrap.engine.executor.channel``) decodes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from bootstrap.engine.request.timing import RequestTiming

REJECTED = "request rejected: "  # how the error of a request that can never run begins (the server's 400)


@dataclass(frozen=True)
class StreamEvent:
    """One streamed step: the new token and the text it completes; the last one has ``finish_reason``.
    With ``params.logprobs`` set, ``logprob`` is the token's and ``top_logprobs`` the most likely
    (token id, logprob) pairs, under the model's raw distribution, and ``text_offset`` where the
    token's text starts in the request's whole text (``text`` may lag it: held back while it
    could start a stop string). The final event carries the request's ``timing`` and
    ``cached_tokens``."""

    token_id: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    timing: RequestTiming | None = None
    text_offset: int | None = None
    cached_tokens: int | None = None  # on the final event: prompt tokens whose KV the prefix cache held

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def rejected(reason: object) -> StreamEvent:
    """The one event of a request refused before it ran: an error naming ``reason``."""
    return StreamEvent(None, "", "error", f"{REJECTED}{reason}")
