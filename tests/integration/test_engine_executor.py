"""PyExecutor behaviour on a tiny random Llama: rejections, failures, streaming, text, stops,
warm-up, cancellation, async use and shutdown."""

from __future__ import annotations

import copy
import threading
import time

import anyio
import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bootstrap.engine import KVCacheSpec, PagedKVCache, SamplingParams, SchedulerConfig, create_executor
from bootstrap.engine.request.sequence import Detokenizer

VOCAB = 256
POISON = 13  # a token id the fault-injection hook refuses


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(99)
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
            param.mul_(4.0) if param.dim() > 1 else None
    return llama


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Token i is the single character chr(0x100 + i); decoding concatenates them."""
    vocab = {chr(0x100 + i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=chr(0x100)))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def make(model, *, kv_tokens=1024, tokens_per_block=4, batch=8, num_tokens=64, seq_len=128, tokenizer=None, eos=None):
    spec = KVCacheSpec.from_config(model.config, torch.float32)
    cache = PagedKVCache.from_tokens(spec, kv_tokens, tokens_per_block, "cpu")
    config = SchedulerConfig(batch, num_tokens, seq_len)
    return create_executor(copy.deepcopy(model), cache, config, tokenizer, eos, start=False)


def expected(model, prompt, max_tokens):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def poison(executor) -> None:
    """Make the executor's model raise on any step that contains the POISON token."""

    def hook(module, args):
        if (args[0] == POISON).any():
            raise RuntimeError("poisoned token in the batch")

    executor.runner.model.model.embed_tokens.register_forward_pre_hook(hook)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([1] * 100, SamplingParams(max_tokens=29), "exceeds max_seq_len (128)"),
        ([], SamplingParams(), "prompt: empty"),
        ([1, 2, VOCAB], SamplingParams(), "must be integers in [0, 256)"),
        ([1, -1], SamplingParams(), "must be integers in [0, 256)"),
        ([1] * 60, SamplingParams(max_tokens=10), "needs 18 KV blocks"),
        ([1, 2], SamplingParams(stop=("x",)), "stop strings need a tokenizer"),
    ],
)
def test_requests_that_can_never_run_are_answered_with_an_error(model, prompt, params, message):
    ex = make(model, kv_tokens=64)  # 16 blocks of 4 tokens
    ex.start_worker()
    response = ex.await_response(ex.enqueue(prompt, params), timeout=30)
    assert response.finish_reason == "error" and not response.ok
    assert message in response.error and response.error.startswith("request rejected")
    ok = ex.await_response(ex.enqueue([5, 6, 7], SamplingParams(max_tokens=3)), timeout=30)
    assert ok.ok and ok.token_ids == expected(model, [5, 6, 7], 3)
    ex.shutdown()


def test_a_failing_request_does_not_fail_its_batch_or_the_loop(model):
    ex = make(model)
    poison(ex)
    ex.start_worker()
    healthy = [[3, 4, 5, 6, 7], [9, 10]]
    ids = [
        ex.enqueue(healthy[0], SamplingParams(max_tokens=4)),
        ex.enqueue([1, 2, POISON, 4], SamplingParams(max_tokens=4)),
        ex.enqueue(healthy[1], SamplingParams(max_tokens=4)),
    ]
    first, bad, second = (ex.await_response(i, timeout=60) for i in ids)
    assert bad.finish_reason == "error" and "poisoned token" in bad.error
    assert first.token_ids == expected(model, healthy[0], 4) and first.ok
    assert second.token_ids == expected(model, healthy[1], 4) and second.ok
    assert ex.worker_running
    later = ex.await_response(ex.enqueue([20, 21], SamplingParams(max_tokens=2)), timeout=60)
    assert later.token_ids == expected(model, [20, 21], 2)
    assert ex.scheduler.kv_cache.stats().used_blocks == 0
    ex.shutdown()


def test_shutdown_joins_worker_cancels_pending_and_releases_pool(model):
    ex = make(model, batch=1, num_tokens=16)
    ex.start_worker()
    worker = ex._worker
    ids = [ex.enqueue([1, 2, 3], SamplingParams(max_tokens=100)) for _ in range(3)]
    ex.shutdown()
    assert not worker.is_alive()
    responses = [ex.await_response(i, timeout=5) for i in ids]
    assert all(r.finish_reason in ("cancelled", "length") for r in responses)
    assert any(r.finish_reason == "cancelled" for r in responses)
    cache = ex.runner.kv_cache
    assert cache.released and cache.stats().total_bytes == 0
    ex.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        ex.enqueue([1], SamplingParams())


def test_stream_yields_each_token_then_the_finish(model):
    ex = make(model, tokenizer=char_tokenizer())
    ex.start_worker()
    prompt = [40, 41, 42, 43, 44, 45]
    request = ex.enqueue(prompt, SamplingParams(max_tokens=7))
    events = list(ex.stream(request))
    assert [e.token_id for e in events] == expected(model, prompt, 7)
    assert [e.finished for e in events] == [False] * 6 + [True]
    assert events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == "".join(chr(0x100 + t) for t in expected(model, prompt, 7))
    with pytest.raises(KeyError, match="unknown request id"):
        ex.await_response(request)  # the stream took the response
    ex.shutdown()


def test_stop_string_ends_the_request_and_is_cut_from_text_and_stream(model):
    tokenizer = char_tokenizer()
    ex = make(model, tokenizer=tokenizer)
    prompt = [7, 8, 9, 10]
    full = ex.generate([prompt], SamplingParams(max_tokens=12))[0].text
    cut = next(k for k in range(1, 10) if full.find(full[k : k + 2]) == k)  # first occurs at k
    stop = full[cut : cut + 2]
    request = ex.enqueue(prompt, SamplingParams(max_tokens=12, stop=(stop,)))
    streamed = list(ex.stream(request))
    text = "".join(e.text for e in streamed)
    assert text == full[:cut] and streamed[-1].finish_reason == "stop"
    response = ex.generate([prompt], SamplingParams(max_tokens=12, stop=(stop,)))[0]
    assert response.text == full[:cut] and len(response.token_ids) == cut + 2
    ex.shutdown()


@pytest.mark.parametrize(
    "stops, cut, tokens",
    [
        ((slice(1, 3), slice(8, 10)), 8, 10),  # the first twice before the 6th token: ignored; the second cuts
        ((slice(4, 6),), 4, 6),  # one that ends in the 6th token counts
    ],
)
def test_stop_strings_count_from_the_min_tokens_th_token_and_stream_and_response_agree(model, stops, cut, tokens):
    ex = make(model, tokenizer=char_tokenizer())
    ex.start_worker()
    prompt = [9, 10]
    full = ex.generate([prompt], SamplingParams(max_tokens=12))[0].text  # one char per token
    stop = tuple(full[s] for s in stops)
    assert [full.find(s) for s in stop] == [s.start for s in stops]  # where each first occurs
    params = SamplingParams(max_tokens=12, stop=stop, min_tokens=6)
    streamed = list(ex.stream(ex.enqueue(prompt, params)))
    response = ex.await_response(ex.enqueue(prompt, params), timeout=60)
    assert "".join(e.text for e in streamed) == response.text == full[:cut]
    assert len(response.token_ids) == tokens and response.finish_reason == "stop"
    ex.shutdown()


def test_stop_token_and_eos(model):
    prompt = [11, 12, 13 + 1]
    tokens = expected(model, prompt, 8)
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    ex = make(model, eos={stop_at})
    by_eos = ex.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert by_eos.token_ids == tokens[: first + 1] and by_eos.finish_reason == "stop"
    ignoring = ex.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert ignoring.token_ids == tokens and ignoring.finish_reason == "length"
    by_stop_id = ex.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(stop_at,)))[0]
    assert by_stop_id.token_ids == tokens[: first + 1]
    ex.shutdown()


def test_seeded_sampling_is_reproducible_whatever_the_batch(model):
    ex = make(model)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    alone = ex.generate([[1, 2, 3]], params)[0].token_ids
    crowd = ex.generate([[9] * 20, [1, 2, 3], [4, 5]], [SamplingParams(max_tokens=5, temperature=1.0), params, params])
    assert crowd[1].token_ids == alone
    ex.shutdown()


def test_a_mixed_batch_samples_its_sampled_requests(model):
    ex = make(model)
    prompt = [1, 2, 3]
    greedy = SamplingParams(max_tokens=8)
    hot = [SamplingParams(max_tokens=8, temperature=1.5, seed=seed) for seed in (7, 8)]
    alone = [ex.generate([prompt], p)[0].token_ids for p in hot]
    mixed = ex.generate([prompt] * 4, [greedy, hot[0], greedy, hot[1]])
    assert mixed[0].token_ids == mixed[2].token_ids == expected(model, prompt, 8)
    assert [mixed[1].token_ids, mixed[3].token_ids] == alone
    assert all(tokens != expected(model, prompt, 8) for tokens in alone)
    ex.shutdown()


def test_warmup_requests_run_without_text(model):
    ex = make(model, tokenizer=char_tokenizer(), num_tokens=32)
    responses = ex.run_warmup(num_tokens=40, num_requests=3, max_tokens=2)
    assert [len(r.prompt_token_ids) for r in responses] == [14, 13, 13]
    assert all(r.is_warmup and r.ok and r.text == "" and len(r.token_ids) == 2 for r in responses)
    assert ex.scheduler.kv_cache.stats().used_blocks == 0
    with pytest.raises(ValueError, match="num_requests"):
        ex.run_warmup(num_tokens=2, num_requests=3)
    ex.shutdown()


def test_cancel_finishes_a_running_request(model):
    ex = make(model)
    ex.start_worker()
    request = ex.enqueue([1, 2, 3], SamplingParams(max_tokens=120 - 3, ignore_eos=True))
    stream = ex.stream(request)
    next(stream)
    ex.cancel(request)
    events = list(stream)
    assert events[-1].finish_reason == "cancelled"
    assert len(events) < 116
    assert ex.scheduler.kv_cache.stats().used_blocks == 0
    ex.shutdown()


async def test_async_stream_and_await(model):
    ex = make(model)
    ex.start_worker()
    prompt = [30, 31, 32]
    tokens = [e.token_id async for e in ex.stream_async(ex.enqueue(prompt, SamplingParams(max_tokens=5)))]
    assert tokens == expected(model, prompt, 5)
    with anyio.fail_after(60):
        response = await ex.await_response_async(ex.enqueue(prompt, SamplingParams(max_tokens=5)))
    assert response.token_ids == tokens
    ex.shutdown()


def test_enqueue_from_many_threads(model):
    ex = make(model, batch=8)
    ex.start_worker()
    prompts = [[i + 1, i + 2, i + 3] for i in range(16)]
    ids: dict[int, int] = {}

    def submit(i: int) -> None:
        ids[i] = ex.enqueue(prompts[i], SamplingParams(max_tokens=3))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        assert ex.await_response(ids[i], timeout=60).token_ids == expected(model, prompt, 3)
    ex.shutdown()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level tokenizer with no merges: token id == byte value."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_detokenizer_holds_back_incomplete_utf8():
    text = "héllo wörld 🙂!"
    detok = Detokenizer(byte_tokenizer())
    deltas = [detok.add(b) for b in text.encode()]
    assert "".join(deltas) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[1:3] == ["", "é"] and deltas[-5:] == ["", "", "", "🙂", "!"]


def test_detokenizer_flushes_a_trailing_partial_character():
    detok = Detokenizer(byte_tokenizer())
    for b in "ok🙂".encode()[:-1]:
        detok.add(b)
    assert detok.text == "ok"
    detok.flush()
    assert detok.text == byte_tokenizer().decode(list("ok🙂".encode()[:-1]))


def test_await_without_worker_drives_steps_and_honours_timeout(model):
    ex = make(model)
    request = ex.enqueue([1, 2, 3], SamplingParams(max_tokens=50))
    with pytest.raises(TimeoutError, match=f"request {request}"):
        ex.await_response(request, timeout=0)
    response = ex.await_response(request)  # still there; this call runs the loop to the end
    assert response.token_ids == expected(model, [1, 2, 3], 50)
    assert not ex.worker_running
    ex.shutdown()


class NarrowTokenizer:
    """A tokenizer that knows only the first half of the model's vocabulary: decoding a higher
    id raises, as a SentencePiece tokenizer does for a model with a padded vocabulary."""

    def __init__(self) -> None:
        self.inner = char_tokenizer()

    def decode(self, ids, skip_special_tokens=False):
        if any(i >= VOCAB // 2 for i in ids):
            raise IndexError("piece id is out of range")
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_request_whose_tokens_cannot_be_decoded_fails_alone(model):
    candidates = [[i, i + 1, i + 2] for i in range(1, 120, 3)]
    runs = {tuple(p): expected(model, p, 6) for p in candidates}
    bad = next(p for p, out in runs.items() if max(out[1:]) >= VOCAB // 2 > out[0])
    good = next(p for p, out in runs.items() if max(out) < VOCAB // 2)
    ex = make(model, tokenizer=NarrowTokenizer())
    ex.start_worker()
    ids = [ex.enqueue(list(good), SamplingParams(max_tokens=6)), ex.enqueue(list(bad), SamplingParams(max_tokens=6))]
    good_response, bad_response = (ex.await_response(i, timeout=30) for i in ids)
    assert bad_response.finish_reason == "error" and "out of range" in bad_response.error
    assert good_response.ok and good_response.token_ids == runs[good]
    assert ex.worker_running and ex.scheduler.kv_cache.stats().used_blocks == 0
    ex.shutdown()


def test_a_shutdown_that_times_out_still_answers_every_request(model):
    ex = make(model, batch=2, num_tokens=16)
    in_step, release = threading.Event(), threading.Event()

    def hold(module, args):  # the worker's step waits here until the test releases it
        in_step.set()
        release.wait(30)

    ex.runner.model.model.embed_tokens.register_forward_pre_hook(hold)
    ex.start_worker()
    worker = ex._worker
    ids = [ex.enqueue([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True)) for _ in range(4)]
    assert in_step.wait(30)
    with pytest.raises(RuntimeError, match=r"did not stop within 0\.1 s"):
        ex.shutdown(timeout=0.1)
    assert worker.is_alive() and not ex.runner.kv_cache.released
    release.set()
    responses = [ex.await_response(i, timeout=30) for i in ids]
    assert [r.finish_reason for r in responses] == ["cancelled"] * 4
    worker.join(30)
    assert not worker.is_alive() and ex.runner.kv_cache.released
    assert ex.stats().handles == 0


def test_starting_the_worker_while_a_caller_drives_the_loop_keeps_outputs_right(model):
    ex = make(model, batch=4)
    prompts = [[i, i + 1, i + 2] for i in range(1, 9)]
    results: list = []
    run = lambda: results.extend(ex.generate(prompts, SamplingParams(max_tokens=40)))  # noqa: E731
    caller = threading.Thread(target=run, daemon=True)  # daemon: a failure here must not hang the process
    caller.start()
    deadline = time.monotonic() + 60
    while ex.runner.kv_cache.stats().used_blocks == 0:  # until the caller thread steps on its own
        assert time.monotonic() < deadline and caller.is_alive(), "the caller thread never stepped"
        time.sleep(0.001)
    ex.start_worker()
    caller.join(120)
    assert not caller.is_alive(), "generate() did not return within 120 s"
    assert [r.token_ids for r in results] == [expected(model, p, 40) for p in prompts]
    assert all(r.ok for r in results)
    assert ex.scheduler.kv_cache.stats().used_blocks == 0
    ex.shutdown()


class WorkerKiller(BaseException):
    """Not an Exception: escapes every ``except Exception`` in the loop and ends the worker."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is reported
def test_a_worker_that_dies_answers_its_requests_instead_of_leaving_waiters_hanging(model):
    ex = make(model)

    def hook(module, args):
        if (args[0] == POISON).any():
            raise WorkerKiller("worker killed")

    ex.runner.model.model.embed_tokens.register_forward_pre_hook(hook)
    ex.start_worker()
    ids = [ex.enqueue([1, 2, POISON], SamplingParams(max_tokens=4)), ex.enqueue([5, 6], SamplingParams(max_tokens=4))]
    responses = [ex.await_response(i, timeout=30) for i in ids]
    assert all(r.finish_reason == "error" and "stopped unexpectedly" in r.error for r in responses)
    assert ex.scheduler.kv_cache.stats().used_blocks == 0
    later = ex.await_response(ex.enqueue([20, 21], SamplingParams(max_tokens=2)), timeout=30)
    assert later.token_ids == expected(model, [20, 21], 2)  # callers now drive the loop themselves
    ex.shutdown()


def test_max_seq_len_beyond_the_models_positions_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)).eval()
    cache = PagedKVCache.from_tokens(KVCacheSpec.from_config(gpt2.config, torch.float32), 256, 4, "cpu")
    with pytest.raises(ValueError, match=r"max_seq_len \(64\) exceeds .* \(16\)"):
        create_executor(gpt2, cache, SchedulerConfig(4, 64, 64), start=False)
    ex = create_executor(gpt2, cache, SchedulerConfig(4, 16, 16), start=False)
    response = ex.generate([[1] * 12], SamplingParams(max_tokens=4))[0]
    assert response.ok and len(response.token_ids) == 4  # the longest request that fits runs
    ex.shutdown()


def test_wrong_argument_types_raise_naming_the_argument(model):
    ex = make(model)
    with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
        ex.enqueue([1, 2, 3], {"max_tokens": 4})
    with pytest.raises(TypeError, match="prompt_token_ids must be a sequence of token ids, got str"):
        ex.enqueue("hello")
    with pytest.raises(TypeError, match="prompt_token_ids must be a sequence of token ids, got NoneType"):
        ex.enqueue(None)
    with pytest.raises(TypeError, match="prompt_token_ids must hold integers, got float"):
        ex.enqueue([1.5, 2.0])
    tensor_ids = torch.tensor([3, 4, 5])  # tensor (and numpy) integers are accepted
    assert ex.await_response(ex.enqueue(tensor_ids, SamplingParams(max_tokens=2))).ok
    ex.shutdown()


def test_a_shut_down_executor_goes_with_its_last_reference_without_a_collection(model):
    """No reference cycle keeps an executor (its runner, its buffers, on CUDA its graphs) alive
    once shut down: a live swap releases one and would otherwise pay a full collection."""
    import gc
    import weakref

    ex = make(model)
    ex.start_worker()
    rid = ex.enqueue([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    ex.await_response(rid, 30)
    ex.shutdown()
    gone = weakref.ref(ex)
    gc.disable()
    try:
        del ex
        assert gone() is None
    finally:
        gc.enable()
