"""Tiny seeded models of several architectures, built in the tests (nothing is downloaded),
and checkpoint directories of them with a word-level tokenizer (``w0`` .. ``w255``)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _llama():
    return LlamaForCausalLM(LlamaConfig(**SHAPE))


def _mistral():  # a sliding window shorter than the prompts
    return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=8))


def _qwen2():  # layer 0 full attention, layer 1 sliding: a hybrid model
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=6, max_window_layers=1))


def _gemma2():  # logit soft-capping that changes the output, explicit head_dim, alternating sliding layers
    config = Gemma2Config(
        **SHAPE,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=30.0,
    )
    return Gemma2ForCausalLM(config)


def _qwen3():  # per-head q and k norms, explicit head_dim
    return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16))


def _gemma():  # scaled embeddings, GELU, norms offset by one
    return GemmaForCausalLM(GemmaConfig(**SHAPE, head_dim=16))


BUILDERS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
}


def build(name: str) -> torch.nn.Module:
    """A seeded tiny model whose greedy output varies from token to token.

    The default init is so small that greedy decoding repeats one token; scaling the matrices
    up fixes that (for Gemma 2 only queries and keys, so attention scores reach the soft cap).
    """
    torch.manual_seed(1234)
    model = BUILDERS[name]().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if name != "gemma2" and param.dim() > 1:
                param.mul_(4.0)
            elif name == "gemma2" and ("q_proj" in param_name or "k_proj" in param_name):
                param.mul_(8.0)
    return model


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token ``i`` is the word ``w{i}``; ``w1`` is BOS, ``w2`` EOS, ``w0`` unknown."""
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", bos_token="w1", eos_token="w2")


# Roles as words: w3 system, w4 user, w5 assistant (a generation prompt ends with w5).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ {'system': 'w3', 'user': 'w4', 'assistant': 'w5'}[m['role']] }} "
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
)


def save_checkpoint(name: str, path: Path, chat_template: str | None = None) -> Path:
    """``build(name)`` saved as a checkpoint directory with its tokenizer (and ``chat_template``,
    e.g. ``CHAT_TEMPLATE``, if given); returns ``path``."""
    model = build(name)
    model.config.eos_token_id, model.config.bos_token_id = 2, 1
    model.generation_config.eos_token_id, model.generation_config.bos_token_id = 2, 1
    model.save_pretrained(path)
    tokenizer = word_tokenizer(model.config.vocab_size)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return path


def last_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits at the last of ``ids``: a transformers model called directly; the engine's own model
    code (which attends through the paged KV cache) in one prefill step of an executor."""
    from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
    from bootstrap.engine.models.decoder import DecoderLM
    from bootstrap.engine.request.sequence import Sequence, next_request_id

    if not isinstance(model, DecoderLM):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1]
    cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(model.config, model.dtype), 256, 4, "cpu")
    ex = create_executor(model, cache, SchedulerConfig(1, 128, 128), start=False)
    try:
        ex.scheduler.add(Sequence(next_request_id(), list(ids), SamplingParams(max_tokens=1)))
        return ex.runner.run(ex.scheduler.schedule())[-1]
    finally:
        ex.scheduler.drain()  # the step ran outside the executor's loop: no request handle to finish
        ex.shutdown()
