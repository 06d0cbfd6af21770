"""Token logprobs in OpenAI's two response shapes, from the engine's stream events.

The engine gives each generated token's logprob and its most likely alternatives as token ids,
under the model's raw distribution (``engine.sampling.processing``). Here they become text, as
vLLM does: each token decoded on its own, ``bytes`` its UTF-8 encoding (``token_id:<id>`` from an
executor without a tokenizer); a logprob that is no finite number (-inf, NaN) as -9999.0 (``shown``).

- chat (``logprobs: true``, ``top_logprobs: k``): ``choices[].logprobs.content[]``, one entry per
  token with ``token``, ``logprob``, ``bytes`` and ``top_logprobs`` (k entries of that shape).
- completions (``logprobs: k``): ``choices[].logprobs`` with the lists ``tokens``,
  ``token_logprobs``, ``top_logprobs`` (per token up to k + 1 entries: the k most likely and the
  sampled token, as OpenAI documents) and ``text_offset`` (where the token's text starts in the
  choice's text, counted from the start of the whole completion, also when streamed).
Streamed, each chunk carries the entries of the tokens it delivers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from bootstrap.serve.openai import schemas as s

if TYPE_CHECKING:
    from bootstrap.engine.request.stream_event import StreamEvent

FLOOR = -9999.0  # vLLM's value for -inf ("the JSON-serializable float that OpenAI uses")


def shown(logprob: float) -> float:
    """``logprob`` as a client gets it, valid JSON: ``FLOOR`` for -inf (a token the model rules
    out, its logit too far below the others' for a float), NaN (logits that overflowed), +inf,
    or anything below ``FLOOR``."""
    return logprob if FLOOR < logprob < math.inf else FLOOR


class TokenDecoder(Protocol):
    """What naming a token takes of the executor's tokenizer (transformers' or ``bootstrap.engine.tokenizer``'s)."""

    def decode(self, token_ids: list[int]) -> str: ...


class LogprobsOut:
    """One choice's logprobs bodies, built event by event (each event is passed once, in order)."""

    def __init__(self, kind: str, tokenizer: TokenDecoder | None) -> None:
        self.kind, self.tokenizer = kind, tokenizer
        self._texts: dict[int, str] = {}
        self._offset = 0  # characters of the choice's text delivered before the next event

    def of(self, events: Iterable[StreamEvent]) -> s.ChatLogprobs | s.CompletionLogprobs:
        """The logprobs of the tokens ``events`` deliver (events without a token add none)."""
        if self.kind == "chat":
            return s.ChatLogprobs(content=[self._chat_entry(e) for e in self._tokens_of(events)])
        out = s.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for event in events:
            if event.token_id is not None and event.logprob is not None:
                top: dict[str, float] = {}
                for i, lp in (*event.top_logprobs, (event.token_id, event.logprob)):
                    key = self.text(i)  # two tokens may share one (byte-level BPE pieces are each U+FFFD)
                    top[key] = max(shown(lp), top.get(key, FLOOR))
                out.tokens.append(self.text(event.token_id))
                out.token_logprobs.append(shown(event.logprob))
                out.top_logprobs.append(top)
                out.text_offset.append(self._offset if event.text_offset is None else event.text_offset)
            self._offset += len(event.text)
        return out

    def _tokens_of(self, events: Iterable[StreamEvent]) -> list[StreamEvent]:
        return [e for e in events if e.token_id is not None and e.logprob is not None]

    def _chat_entry(self, event: StreamEvent) -> s.ChatTokenLogprob:
        token = self.text(event.token_id)
        top = [
            s.TopLogprob(token=t, logprob=shown(lp), bytes=list(t.encode()))
            for t, lp in ((self.text(i), lp) for i, lp in event.top_logprobs)
        ]
        logprob = shown(event.logprob)
        return s.ChatTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top)

    def text(self, token_id: int) -> str:
        """The token decoded on its own (cached: the same alternatives come back step after step);
        ``token_id:<id>`` when the executor has no tokenizer (vLLM's spelling for token ids)."""
        text = self._texts.get(token_id)
        if text is None:
            decoded = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            text = self._texts[token_id] = decoded
        return text
