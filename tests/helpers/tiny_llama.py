"""A tiny random Llama and executors over it, for the executor tests (built here, nothing downloaded)."""

from __future__ import annotations

import copy
import threading
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bootstrap.engine import KVCacheSpec, PagedKVCache, SchedulerConfig, create_executor

VOCAB = 256


def build_model(seed: int = 99) -> LlamaForCausalLM:
    """Seeded, float32, two layers; its matrices scaled up so greedy output varies token to token."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=None,
        bos_token_id=None,
    )
    llama = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in llama.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
    return llama


def make_executor(
    model,
    *,
    kv_tokens=1024,
    tokens_per_block=4,
    batch=8,
    num_tokens=64,
    seq_len=128,
    overlap=False,
    prefix_caching=False,
    **kwargs,
):
    """An executor over a copy of ``model``, its worker not started."""
    spec = KVCacheSpec.from_config(model.config, torch.float32)
    cache = PagedKVCache.from_tokens(spec, kv_tokens, tokens_per_block, "cpu")
    config = SchedulerConfig(batch, num_tokens, seq_len, prefix_caching, overlap)
    return create_executor(copy.deepcopy(model), cache, config, start=False, **kwargs)


def reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy output for ``prompt``."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def cpu_seconds_over(seconds: float) -> float:
    """CPU time the whole process spends while this thread sleeps ``seconds``."""
    start = time.process_time()
    time.sleep(seconds)
    return time.process_time() - start


class Throttle:
    """Holds the executor's model before each forward until the test lets it through:
    ``allow(n)`` lets ``n`` more forwards run, ``open()`` lets every later one run."""

    def __init__(self, executor) -> None:
        self._cond = threading.Condition()
        self._permits = 0
        self._open = False
        executor.runner.model.model.embed_tokens.register_forward_pre_hook(self._hook)

    def allow(self, n: int = 1) -> None:
        with self._cond:
            self._permits += n
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def _hook(self, module, args) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._open or self._permits > 0, timeout=30):
                raise RuntimeError("the test's throttle held the model for 30 s")
            if not self._open:
                self._permits -= 1
