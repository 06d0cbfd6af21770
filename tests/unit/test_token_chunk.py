"""A token's SSE chunk, written from the request's template (``Render.token_chunk``, a stream's
hot path), is byte for byte the chunk the pydantic models give (``sse(Render.chunk(...))``):
chat and completions, with and without logprobs, any text (quotes, control characters, emoji,
line separators), a model name that needs escaping, choices past the first."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from bootstrap.engine.request.stream_event import StreamEvent
from bootstrap.serve.openai.render import Render, sse


class Names:
    def decode(self, token_ids: list[int]) -> str:
        return {5: "five", 7: '"seven"\n', 9: "\ufffd"}.get(token_ids[0], f"t{token_ids[0]}")


def pair(kind: str, logprobs: bool, model: str) -> tuple[Render, Render]:
    """Two renders of one request: one answers with the template, one with the models."""
    template, models = Render(kind, model, logprobs, Names()), Render(kind, model, logprobs, Names())
    models.id, models.created = template.id, template.created
    return template, models


@given(
    kind=st.sampled_from(["chat", "completion"]),
    logprobs=st.booleans(),
    model=st.text(max_size=12),
    index=st.integers(0, 300),
    texts=st.lists(st.text(), min_size=1, max_size=4),
    logprob=st.sampled_from([-0.25, -1e-07, -123.5, -math.inf, math.nan, 0.0]),
)
def test_the_template_writes_what_the_models_write(kind, logprobs, model, index, texts, logprob):
    template, models = pair(kind, logprobs, model)
    for i, text in enumerate(texts):  # offsets and each choice's logprobs state advance alike
        event = StreamEvent(5 + 2 * (i % 3), text, logprob=logprob, top_logprobs=((7, -2.5), (9, logprob)))
        assert template.token_chunk(index, event) == sse(models.chunk(index, text=text, events=[event]))
