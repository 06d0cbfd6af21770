"""``InFlight``: a step's sampled tokens on their way to the host (overlap scheduling).

A step's sampling is queued on the device with the copies of its tokens (and logprobs) to the
host; the loop schedules and launches the next step before it reads them (``read``), so the
host's work for step N+1 runs while the device runs step N, as TensorRT-LLM's overlap scheduler
does. The next step runs each in-flight token from the device (``feed``); a request whose token
ends it (EOS, a stop string) wastes that one step, and one that ends by length is not scheduled
again (``Sequence.ends_in_flight``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from bootstrap.engine.request.sequence import Sequence
from bootstrap.engine.sampling.processing import TokenLogprob, logprob_entries
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.engine.step.batch import ScheduledBatch
from bootstrap.engine.step.decode_step import queued_tensor
from bootstrap.engine.step.model_runner import Feed


@dataclass
class InFlight:
    """The requests that sampled in one step (row order), their tokens on the device and the
    host copies being made of them (tokens, then the logprob tensors)."""

    seqs: list[Sequence]
    params: list[SamplingParams]
    tokens: torch.Tensor
    copies: list[torch.Tensor]
    copied: torch.cuda.Event | None

    @classmethod
    def launch(cls, seqs: list[Sequence], tokens: torch.Tensor, logprobs: Seq[torch.Tensor]) -> InFlight:
        """Queue the copies of ``tokens`` and ``logprobs`` to the host behind the step's work."""
        if tokens.device.type != "cuda":
            return cls(seqs, [s.params for s in seqs], tokens, [tokens, *logprobs], None)
        copies = []
        for tensor in (tokens, *logprobs):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            copies.append(host.copy_(tensor, non_blocking=True))
        copied = torch.cuda.Event()
        copied.record()
        return cls(seqs, [s.params for s in seqs], tokens, copies, copied)

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The tokens and logprobs on the host: waits for this step's copies only, not for a
        step queued after it."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.copies[0].tolist(), logprob_entries(self.copies[1:], self.params)

    def feed(self, batch: ScheduledBatch) -> Feed | None:
        """The device ids for ``batch``'s requests whose last token is this step's, at their
        flat index in the step (the last of their tokens); None when it has none."""
        rows = {id(seq): row for row, seq in enumerate(self.seqs)}
        index, sources, flat = [], [], -1
        for seq, count in zip(batch.seqs, batch.num_new_tokens):
            flat += count
            if seq.in_flight:
                if id(seq) not in rows:
                    raise RuntimeError(f"request {seq.request_id} has a token in flight from no step in flight")
                index.append(flat)
                sources.append(rows[id(seq)])
        if not index:
            return None
        return Feed(index, self.tokens.index_select(0, queued_tensor(self.tokens.device, sources)))
