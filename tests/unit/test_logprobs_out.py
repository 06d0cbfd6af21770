"""``LogprobsOut``: the engine's stream events in OpenAI's two logprobs shapes, event by event."""

from __future__ import annotations

from bootstrap.engine.request.sequence import StreamEvent
from bootstrap.serve.openai.logprobs import FLOOR, LogprobsOut


class Words:
    """A tokenizer whose token i is the word ``w<i>``."""

    def __init__(self) -> None:
        self.decoded: list[list[int]] = []

    def decode(self, ids: list[int]) -> str:
        self.decoded.append(ids)
        return " ".join(f"w{i}" for i in ids)


EVENTS = [
    StreamEvent(5, "w5", logprob=-0.5, top_logprobs=((5, -0.5), (9, -1.5))),
    StreamEvent(9, "", logprob=-2.0, top_logprobs=((5, -0.25), (7, -1.0))),  # text held back
    StreamEvent(7, " w9 w7", "stop", logprob=-0.1, top_logprobs=((7, -0.1), (5, -3.0))),
]


def test_completion_shape_offsets_count_the_whole_text_across_calls():
    out = LogprobsOut("completion", Words())
    first, rest = out.of(EVENTS[:1]), out.of(EVENTS[1:])
    assert first.tokens == ["w5"] and first.text_offset == [0]
    assert rest.tokens == ["w9", "w7"] and rest.token_logprobs == [-2.0, -0.1]
    assert rest.text_offset == [2, 2]  # the held-back token starts where the next text does
    # the two most likely and the sampled token (w9 is outside its step's top: added)
    assert rest.top_logprobs == [{"w5": -0.25, "w7": -1.0, "w9": -2.0}, {"w7": -0.1, "w5": -3.0}]


def test_chat_shape_and_each_token_decoded_once():
    words = Words()
    out = LogprobsOut("chat", words)
    content = out.of(EVENTS).content
    assert [(e.token, e.logprob, e.bytes) for e in content] == [
        ("w5", -0.5, [119, 53]),
        ("w9", -2.0, [119, 57]),
        ("w7", -0.1, [119, 55]),
    ]
    assert [[t.token for t in e.top_logprobs] for e in content] == [["w5", "w9"], ["w5", "w7"], ["w7", "w5"]]
    assert sorted(map(tuple, words.decoded)) == [(5,), (7,), (9,)]  # cached: one decode per token id


class Pieces(Words):
    """Ids 3 and 4 are each a piece of one UTF-8 character: each decodes alone to U+FFFD, as byte-level BPE does."""

    def decode(self, ids: list[int]) -> str:
        return "\ufffd" if ids in ([3], [4]) else super().decode(ids)


def test_tokens_that_decode_alike_keep_the_most_likely_value():
    out = LogprobsOut("completion", Pieces())
    events = [
        StreamEvent(5, "w5", logprob=-0.2, top_logprobs=((5, -0.2), (3, -1.0), (4, -2.0))),
        StreamEvent(4, "", logprob=-2.5, top_logprobs=((3, -0.5), (5, -1.0))),  # sampled 4, less likely than 3
    ]
    assert out.of(events).top_logprobs == [{"w5": -0.2, "\ufffd": -1.0}, {"\ufffd": -0.5, "w5": -1.0}]


def test_without_a_tokenizer_tokens_are_named_by_id():
    out = LogprobsOut("completion", None)
    assert out.of(EVENTS[:1]).tokens == ["token_id:5"]


def test_logprobs_that_are_no_finite_number_are_written_as_vllms_floor():
    """-inf (a token ruled out) and NaN (logits that overflowed) are -9999.0 in both shapes, so
    the body stays JSON; a finite logprob is kept as it is."""
    inf, nan = float("-inf"), float("nan")
    events = [StreamEvent(5, "w5", logprob=nan, top_logprobs=((5, nan), (9, inf))), StreamEvent(9, "", logprob=-2.5)]
    completion = LogprobsOut("completion", Words()).of(events)
    assert completion.token_logprobs == [FLOOR, -2.5]
    assert completion.top_logprobs == [{"w5": FLOOR, "w9": FLOOR}, {"w9": -2.5}]
    chat = LogprobsOut("chat", Words()).of(events).content
    assert [(e.logprob, [t.logprob for t in e.top_logprobs]) for e in chat] == [(FLOOR, [FLOOR, FLOOR]), (-2.5, [])]
    assert FLOOR == -9999.0
