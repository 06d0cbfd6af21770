"""The live operations through the Python API, on the real engine on the CPU: a swap, a weights
update, sleep and wake each give the tokens a fresh start of the same model or weights gives;
a refusal changes nothing; a failure after the release resumes; cancelling one mid-way loses
nothing; twenty swaps leave no thread, pool or request behind."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import torch
from safetensors.torch import load_file, save_file

from bootstrap.api import Bootstrap, Busy, Refused
from bootstrap.backends.native import loading as loading_module
from bootstrap.config import BootstrapConfig
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.pipeline import StageFailed

PROMPT = [1, 7, 9, 4, 11, 3]


@pytest.fixture(scope="module")
def llama_tuned(llama, tmp_path_factory) -> Path:
    """The llama checkpoint with other weights: every matrix scaled and shifted (an "RL step")."""
    return perturbed(llama, tmp_path_factory.mktemp("ckpt") / "tuned", seed=7)


def perturbed(source: Path, target: Path, seed: int, drop: str | None = None, reshape: str | None = None) -> Path:
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if tensor.dim() > 1:
            tensors[name] = tensor + 0.5 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
    if drop is not None:
        del tensors[drop]
    if reshape is not None:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def config(path: Path, **extra) -> BootstrapConfig:
    return BootstrapConfig(model=str(path), device="cpu", max_num_tokens=64, max_batch_size=4, **extra)


def greedy(executor, prompt=PROMPT, tokens: int = 12) -> list[int]:
    rid = executor.enqueue(list(prompt), SamplingParams(max_tokens=tokens, ignore_eos=True))
    return list(executor.await_response(rid, 60).token_ids)


async def fresh_tokens(cfg: BootstrapConfig) -> list[int]:
    boot = Bootstrap(cfg)
    try:
        return greedy(await boot.build())
    finally:
        await boot.aclose()


def worker_threads() -> set[str]:
    """The package's own threads (device threads, executor workers, weight readers)."""
    return {t.name for t in threading.enumerate() if t.name.startswith("bootstrap")}


def test_swap_update_sleep_and_wake_answer_as_a_fresh_start(llama, qwen, llama_tuned):
    async def main():
        expected = {
            "llama": await fresh_tokens(config(llama)),
            "qwen": await fresh_tokens(config(qwen)),
            "tuned": await fresh_tokens(config(llama_tuned)),
        }
        assert expected["llama"] != expected["tuned"] != expected["qwen"]
        boot = Bootstrap(config(llama))
        try:
            first = await boot.build()
            assert greedy(first) == expected["llama"]
            swapped = await boot.swap(config(qwen))
            assert swapped is boot.executor and not first.is_running
            assert greedy(swapped) == expected["qwen"]
            await boot.swap(config(llama))
            updated = await boot.update_weights(llama_tuned)
            assert greedy(updated) == expected["tuned"]
            await boot.sleep(1)
            assert boot.asleep == 1 and boot.executor is None
            assert greedy(await boot.wake()) == expected["tuned"]
            await boot.sleep(2)
            assert boot.asleep == 2 and boot.executor is None
            assert greedy(await boot.wake()) == expected["tuned"]  # the source, then the update's files again
            names = [(r.name, r.outcome) for r in boot.operations]
            assert names == [
                ("swap", "ok"),
                ("swap", "ok"),
                ("weights", "ok"),
                ("sleep", "ok"),
                ("wake", "ok"),
                ("sleep", "ok"),
                ("wake", "ok"),
            ]
        finally:
            await boot.aclose()

    anyio.run(main)


def test_the_weights_update_writes_in_place_and_keeps_the_pool_whole(llama, llama_tuned):
    async def main():
        boot = Bootstrap(config(llama))
        try:
            await boot.build()
            model = boot.pipeline.artifacts["loaded"].handle.target.model
            pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
            pool = boot.pipeline.artifacts["final"].handle.pools["target"]
            await boot.update_weights(llama_tuned)
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers
            assert boot.pipeline.artifacts["final"].handle.pools["target"] is pool
            assert boot.executor.engine_stats().kv_used_blocks == 0
            rows = {row["id"]: row["outcome"] for row in boot.report().stages}
            assert rows == {"check_weights": "ok", "read_weights": "ok", "scheduler_sampler": "ok"}
            record = boot.operations[-1]
            assert record.drain_s is not None and record.release_s is not None and record.duration_s >= record.release_s
        finally:
            await boot.aclose()

    anyio.run(main)


def test_new_weights_a_swap_and_a_sleep_leave_no_cached_prefix_behind(llama, qwen, llama_tuned):
    """The prefix cache holds keys and values of the weights that computed them: a weights update
    (its pool kept), a swap and a level-2 sleep each start the next engine with none cached."""
    prompt = [(5 * i + 2) % 200 + 3 for i in range(80)]  # 2 full blocks of 32 and more

    def cached(executor) -> tuple[int, list[int]]:
        response = executor.await_response(executor.enqueue(prompt, SamplingParams(max_tokens=4, ignore_eos=True)), 60)
        return response.cached_tokens, list(response.token_ids)

    async def main():
        fresh = Bootstrap(config(llama_tuned))
        try:
            _, tuned_tokens = cached(await fresh.build())
        finally:
            await fresh.aclose()
        boot = Bootstrap(config(llama))
        try:
            executor = await boot.build()
            assert cached(executor)[0] == 0 and cached(executor)[0] == 64
            assert cached(await boot.update_weights(llama_tuned)) == (0, tuned_tokens)
            assert cached(boot.executor)[0] == 64
            await boot.swap(config(qwen))
            assert cached(boot.executor)[0] == 0
            await boot.sleep(2)
            assert cached(await boot.wake())[0] == 0
        finally:
            await boot.aclose()

    anyio.run(main)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"drop": "model.layers.0.mlp.down_proj.weight"}, "model.layers.0.mlp.down_proj.weight"),
        ({"reshape": "model.layers.1.self_attn.o_proj.weight"}, "model.layers.1.self_attn.o_proj.weight"),
    ],
)
def test_weights_of_another_shape_or_missing_are_refused_and_change_nothing(llama, tmp_path, change, named):
    bad = perturbed(llama, tmp_path / "bad", seed=3, **change)

    async def main():
        boot = Bootstrap(config(llama))
        try:
            executor = await boot.build()
            before = greedy(executor)
            with pytest.raises(Refused, match=named.replace(".", r"\.")):
                await boot.update_weights(bad)
            assert boot.executor is executor and executor.is_running
            assert greedy(executor) == before
            assert boot.operations[-1].outcome == "refused"
        finally:
            await boot.aclose()

    anyio.run(main)


def test_a_bad_source_for_a_swap_is_refused_while_the_old_model_serves(llama, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    untokenizable = shutil.copytree(llama, tmp_path / "untokenizable")  # weights whole, tokenizer.json not
    (untokenizable / "tokenizer.json").write_text("{not json")

    async def main():
        boot = Bootstrap(config(llama))
        try:
            executor = await boot.build()
            table = dict(boot.pipeline.status)
            for bad in (config(tmp_path / "missing"), config(broken), config(untokenizable)):
                with pytest.raises(Refused, match="resolve_classes"):
                    await boot.swap(bad)
                assert boot.executor is executor and executor.is_running
                assert boot.pipeline.status == table
            with pytest.raises(Refused, match="device"):
                await boot.swap(config(llama).model_copy(update={"device": "cuda"}))
            assert greedy(executor)
        finally:
            await boot.aclose()

    anyio.run(main)


def test_a_swap_loads_the_new_tokenizer_once_while_the_old_model_serves(llama, qwen, monkeypatch):
    """``resolve_classes`` loads it (the swap's check, before the release); ``load_model`` takes it."""
    loads: list[tuple[str, bool]] = []
    load = loading_module.checkpoint_tokenizer

    def counting(path):
        loads.append((Path(path).name, serving.executor is not None and serving.executor.is_running))
        return load(path)

    monkeypatch.setattr(loading_module, "checkpoint_tokenizer", counting)
    serving = Bootstrap(config(llama))

    async def main():
        try:
            await serving.build()
            await serving.swap(config(qwen))
            assert serving.executor.tokenizer is not None and greedy(serving.executor)
        finally:
            await serving.aclose()

    anyio.run(main)
    assert loads == [(llama.name, False), (qwen.name, True)]


def test_one_operation_at_a_time_and_each_checks_the_state_first(llama):
    async def main():
        boot = Bootstrap(config(llama))
        try:
            with pytest.raises(Busy, match="no executor"):
                await boot.sleep(1)
            with pytest.raises(Busy, match="not asleep"):
                await boot.wake()
            with pytest.raises(Refused, match="level"):
                await boot.sleep(3)
            await boot.build()
            async with anyio.create_task_group() as tg:
                tg.start_soon(boot.sleep, 1)
                await anyio.lowlevel.checkpoint()
                with pytest.raises(Busy, match="sleep"):
                    await boot.swap(config(llama))
            with pytest.raises(Busy, match="asleep"):
                await boot.update_weights(llama)
            await boot.wake()
        finally:
            await boot.aclose()

    anyio.run(main)


def test_a_failure_after_the_release_resumes_from_its_stage_and_a_swap_back_works(llama, qwen, monkeypatch):
    from bootstrap.backends.native.backend import NativeBackend

    real, fail = NativeBackend.build_final, {"left": 1}

    def failing_once(self, *args, **kwargs):
        if fail["left"]:
            fail["left"] -= 1
            raise RuntimeError("the pools could not be made")
        return real(self, *args, **kwargs)

    async def main():
        boot = Bootstrap(config(llama))
        try:
            await boot.build()
            monkeypatch.setattr(NativeBackend, "build_final", failing_once)
            with pytest.raises(StageFailed) as failed:
                await boot.swap(config(qwen))
            assert failed.value.stage == "final_build" and boot.executor is None
            assert boot.pipeline.status["load_model"].state == "done"  # the new weights stay loaded
            assert greedy(await boot.retry()) == await fresh_tokens(config(qwen))
            fail["left"] = 1
            with pytest.raises(StageFailed):
                await boot.swap(config(llama))
            assert greedy(await boot.swap(config(llama))) == await fresh_tokens(config(llama))
        finally:
            await boot.aclose()

    anyio.run(main)


def test_a_cancelled_operation_loses_nothing_and_a_retry_finishes_it(llama, qwen):
    async def main():
        boot = Bootstrap(config(llama))
        try:
            await boot.build()
            with anyio.move_on_after(0) as scope:  # cancelled at its first wait
                await boot.swap(config(qwen))
            assert scope.cancelled_caught and boot.busy is None
            assert boot.operations[-1].outcome == "cancelled"
            executor = boot.executor or await boot.retry()
            assert greedy(executor)
        finally:
            await boot.aclose()
        assert not boot.pipeline.artifacts.get("executor") or not boot.pipeline.artifacts["executor"].is_running

    anyio.run(main)


def test_twenty_swaps_leave_no_thread_pool_or_request_behind(llama, qwen):
    async def main():
        boot = Bootstrap(config(llama))
        try:
            await boot.build()
            threads, previous = worker_threads(), boot.executor
            for cycle in range(20):
                executor = await boot.swap(config(qwen if cycle % 2 == 0 else llama))
                stats = previous.engine_stats()  # published by its shutdown: every request and block back
                assert (stats.running, stats.waiting, stats.kv_used_blocks) == (0, 0, 0)
                assert not previous.is_running and worker_threads() == threads
                greedy(executor, tokens=3)
                previous = executor
            assert [r.outcome for r in boot.operations] == ["ok"] * 20
        finally:
            await boot.aclose()

    anyio.run(main)


def test_a_swap_cancelled_in_its_drain_leaves_no_thread_after_aclose(llama, qwen):
    async def main():
        threads = worker_threads()
        boot = Bootstrap(config(llama))
        draining = anyio.Event()

        async def drain_forever() -> None:
            draining.set()
            await anyio.sleep_forever()

        try:
            executor = await boot.build()
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: boot.swap(config(qwen), drain=drain_forever))
                await draining.wait()  # checked: the new pipeline holds its device thread now
                tg.cancel_scope.cancel()
            assert boot.operations[-1].outcome == "cancelled"
            assert boot.executor is executor and greedy(executor)  # nothing was released yet
        finally:
            await boot.aclose()
        assert worker_threads() == threads

    anyio.run(main)


def test_a_swap_frees_the_old_executor_without_a_garbage_collection(llama, qwen):
    """What the old model held goes with its last reference as the swap releases it: no full
    collection (a quarter of a second in a real server) is needed to free it."""
    import gc
    import weakref

    async def main():
        boot = Bootstrap(config(llama))
        try:
            old = weakref.ref(await boot.build())
            gc.collect()
            gc.disable()
            try:
                swapped = weakref.ref(await boot.swap(config(qwen)))
                assert old() is None  # built by the start
                await boot.swap(config(llama))
                assert swapped() is None  # built by a swap
            finally:
                gc.enable()
        finally:
            await boot.aclose()

    anyio.run(main)


def test_a_level_2_sleep_releases_the_weights_and_the_wake_loads_them_again(llama):
    """Level 1 keeps the model (its weights in host memory) and its wake restores them; level 2
    releases the weights (every parameter's storage gone, the loaded artifact dropped) and its
    wake runs ``load_model`` again: a new model, read from the source."""

    def parameters_on(model: torch.nn.Module) -> set[str]:
        return {p.device.type for p in model.parameters()}

    async def main():
        expected = await fresh_tokens(config(llama))
        boot = Bootstrap(config(llama))
        try:
            await boot.build()
            first = boot.pipeline.artifacts["loaded"].handle.target.model
            await boot.sleep(1)
            assert boot.pipeline.artifacts["loaded"].handle.target.model is first
            assert greedy(await boot.wake()) == expected
            rows = {row["id"]: row["outcome"] for row in boot.report().stages}
            assert rows["restore_weights"] == "ok" and "load_model" not in rows
            assert boot.pipeline.artifacts["loaded"].handle.target.model is first

            await boot.sleep(2)
            assert "loaded" not in boot.pipeline.artifacts
            assert parameters_on(first) == {"meta"}  # the storage released, whoever still holds the model
            assert greedy(await boot.wake()) == expected
            rows = {row["id"]: row["outcome"] for row in boot.report().stages}
            assert rows["load_model"] == "ok" and "restore_weights" not in rows
            again = boot.pipeline.artifacts["loaded"].handle.target.model
            assert again is not first and parameters_on(again) == {"cpu"}
        finally:
            await boot.aclose()

    anyio.run(main)
