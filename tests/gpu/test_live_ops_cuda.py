"""The live operations (``Bootstrap.sleep``, ``wake``, ``update_weights``, ``swap``) on a CUDA
device, on tiny float32 checkpoints with a 4 GiB KV pool: a sleep at either level gives back the
executor's device memory (``torch.cuda.mem_get_info``) and the wake captures CUDA graphs again,
replays them and answers the same tokens; a weights update keeps every parameter's address and
the graphs, and answers as a fresh start on the new weights; a swap to a model of another shape
and back answers as fresh starts of each."""

from __future__ import annotations

import gc
from pathlib import Path

import anyio
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from helpers.broken_checkpoints import copy_checkpoint, replace_tensors  # noqa: E402
from helpers.tiny_models import save_checkpoint, word_tokenizer  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from bootstrap.api import Bootstrap  # noqa: E402
from bootstrap.config import BootstrapConfig  # noqa: E402
from bootstrap.devices import CudaDevice  # noqa: E402
from bootstrap.engine.sampling.sampler import SamplingParams  # noqa: E402
from bootstrap.engine.step.graphs import release_workspaces  # noqa: E402

PROMPTS = [[1, 7, 9, 4, 11, 3], [5, 6, 7], [200, 13, 8, 21]]  # three rows at once: the 4-row graphs
GIVEN_BACK = 0.95  # the share of the executor's device memory a sleep must give back
KV_BYTES = 4 << 30


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="module")
def tuned(llama, tmp_path_factory) -> Path:
    """The llama checkpoint with other values in every matrix (same shapes)."""
    target = copy_checkpoint(llama, tmp_path_factory.mktemp("ckpt") / "tuned")
    generator = torch.Generator().manual_seed(7)

    def shifted(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            name: t + 0.5 * torch.randn(t.shape, generator=generator, dtype=t.dtype) if t.dim() > 1 else t
            for name, t in tensors.items()
        }

    replace_tensors(target, shifted)
    return target


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """A Qwen2 of another shape than the llama (3 layers, width 96, 6 heads), same vocabulary."""
    path = tmp_path_factory.mktemp("ckpt") / "qwen2-other"
    torch.manual_seed(99)
    shape = dict(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, num_key_value_heads=2, max_position_embeddings=512)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(4.0)  # tokens that vary (as ``helpers.tiny_models.build``)
    model.config.eos_token_id, model.config.bos_token_id = 2, 1
    model.generation_config.eos_token_id, model.generation_config.bos_token_id = 2, 1
    model.save_pretrained(path)
    word_tokenizer(256).save_pretrained(path)
    return path


def config(path: Path) -> BootstrapConfig:
    """A 4 GiB pool (not the whole device, as a server's: quicker, and a few hundred MiB left
    behind by a sleep would show in the share given back)."""
    shape = dict(max_seq_len=256, max_num_tokens=64, max_batch_size=4, max_kv_bytes=KV_BYTES)
    return BootstrapConfig(model=str(path), device="cuda", dtype="float32", **shape)


@pytest.fixture(scope="module", autouse=True)
def cuda_warm(llama):
    """One start and release first: the kernels and libraries a start loads for the process's life
    are loaded before a test reads the free memory it compares against."""

    async def once() -> None:
        boot = Bootstrap(config(llama))
        try:
            greedy(await boot.build())
        finally:
            await boot.aclose()

    anyio.run(once)


def settled_free() -> int:
    """Free device bytes with nothing of this test's left: garbage collected, torch's cache and
    the cuBLAS workspaces given back (as the backend does once no graph is alive)."""
    gc.collect()
    torch.cuda.synchronize()
    assert release_workspaces(), "a CUDA graph capture is still alive"
    CudaDevice().empty_cache()
    return torch.cuda.mem_get_info()[0]


def greedy(executor) -> list[list[int]]:
    ids = [executor.enqueue(list(p), SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS]
    return [list(executor.await_response(rid, 120).token_ids) for rid in ids]


def counting_replays(executor) -> list[tuple[int, int]]:
    """The buckets the executor's runner replays from now on."""
    graphs = executor.runner.graphs
    assert graphs is not None, "no CUDA graphs captured"
    seen: list[tuple[int, int]] = []
    replay = graphs.replay
    graphs.replay = lambda bucket: seen.append(bucket) or replay(bucket)
    return seen


async def fresh_tokens(path: Path) -> list[list[int]]:
    boot = Bootstrap(config(path))
    try:
        return greedy(await boot.build())
    finally:
        await boot.aclose()


def outcomes(boot: Bootstrap) -> dict[str, str]:
    return {row["id"]: row["outcome"] for row in boot.report().stages}


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_device_back_and_wake_captures_and_replays_graphs_again(llama, level):
    anyio.run(_sleep_and_wake, llama, level)


async def _sleep_and_wake(llama: Path, level: int) -> None:
    free_before = settled_free()
    allocated_before = torch.cuda.memory_allocated()
    boot = Bootstrap(config(llama))
    try:
        executor = await boot.build()
        weight_bytes = boot.pipeline.artifacts["loaded"].weight_bytes
        captured = boot.pipeline.artifacts["warmup"]
        assert captured.num_graphs > 0
        expected = greedy(executor)
        free_serving = torch.cuda.mem_get_info()[0]
        await boot.sleep(level)
        free_asleep = torch.cuda.mem_get_info()[0]  # as the sleep left it: nothing collected or emptied here
        assert boot.asleep == level and boot.executor is None and not executor.is_running
        held = free_before - free_serving
        assert held >= 0.9 * KV_BYTES  # the pool, at least
        fraction = (free_asleep - free_serving) / held
        assert fraction >= GIVEN_BACK, (
            f"level {level}: {fraction:.4f} of {held / 2**30:.2f} GiB given back; "
            f"{(free_before - free_asleep) / 2**20:.1f} MiB still held"
        )
        # the weights too (the share above is mostly the pool's): nothing, a view of a parameter
        # left in a finished read's plan included, keeps their device storage
        kept = torch.cuda.memory_allocated() - allocated_before
        assert kept < weight_bytes // 4, f"level {level}: {kept} bytes allocated asleep, weights {weight_bytes}"

        woken = await boot.wake()
        rows = outcomes(boot)
        assert rows["warmup"] == "ok" and rows["restore_weights" if level == 1 else "load_model"] == "ok"
        again = boot.pipeline.artifacts["warmup"]
        assert again is not captured and again.num_graphs == captured.num_graphs > 0
        replays = counting_replays(woken)
        assert greedy(woken) == expected
        assert replays and {batch for batch, _ in replays} <= set(again.batch_sizes)
    finally:
        await boot.aclose()


def test_a_weights_update_keeps_the_addresses_and_graphs_and_answers_as_a_fresh_start(llama, tuned):
    anyio.run(_weights_update, llama, tuned)


async def _weights_update(llama: Path, tuned: Path) -> None:
    expected = await fresh_tokens(tuned)
    boot = Bootstrap(config(llama))
    try:
        before = greedy(await boot.build())
        model = boot.pipeline.artifacts["loaded"].handle.target.model
        pointers = {name: param.data_ptr() for name, param in model.named_parameters()}
        captured = boot.pipeline.artifacts["warmup"]
        assert captured.num_graphs > 0

        updated = await boot.update_weights(tuned)
        assert {name: param.data_ptr() for name, param in model.named_parameters()} == pointers
        assert boot.pipeline.artifacts["warmup"] is captured  # not captured again: the addresses held
        assert updated.runner is captured.handle["target"]  # the new executor replays those graphs
        assert outcomes(boot) == {"check_weights": "ok", "read_weights": "ok", "scheduler_sampler": "ok"}
        replays = counting_replays(updated)
        assert greedy(updated) == expected != before
        assert replays
    finally:
        await boot.aclose()


def test_a_swap_to_another_shape_and_back_answers_as_fresh_starts(llama, other):
    anyio.run(_swap_and_back, llama, other)


async def _swap_and_back(llama: Path, other: Path) -> None:
    expected_other = await fresh_tokens(other)
    boot = Bootstrap(config(llama))
    try:
        first = await boot.build()
        expected = greedy(first)
        llama_pool = boot.pipeline.artifacts["final"].handle.pools["target"]

        swapped = await boot.swap(config(other))
        assert not first.is_running and boot.pipeline.artifacts["warmup"].num_graphs > 0
        pool = boot.pipeline.artifacts["final"].handle.pools["target"]
        assert pool is not llama_pool and llama_pool.released
        replays = counting_replays(swapped)
        assert greedy(swapped) == expected_other != expected
        assert replays

        back = await boot.swap(config(llama))
        assert not swapped.is_running and boot.pipeline.artifacts["warmup"].num_graphs > 0
        replays = counting_replays(back)
        assert greedy(back) == expected and replays
        assert [(r.name, r.outcome) for r in boot.operations] == [("swap", "ok"), ("swap", "ok")]
    finally:
        await boot.aclose()
