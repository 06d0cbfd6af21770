"""The native backend's lifecycle: what a build allocates is released after a normal shutdown, a
failure and a cancellation (mid-``profiling`` and mid-``final_build``), and no thread is left.

Every KV pool and every loaded model is recorded as it is made; "released" means the pool tensor
is gone and every parameter moved to the ``meta`` device (its storage freed). Device bytes are
measured on CUDA in ``tests/gpu``; the CPU's resident set is too noisy to compare here.
"""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
from helpers.tiny_models import save_checkpoint

import bootstrap
from bootstrap.api import Bootstrap
from bootstrap.backends.native import backend as native
from bootstrap.backends.native import loading
from bootstrap.config import BootstrapConfig
from bootstrap.engine.kv_cache import PagedKVCache
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.pipeline import StageFailed


@pytest.fixture(scope="module")
def draft_ckpt(tmp_path_factory) -> Path:
    return save_checkpoint("mistral", tmp_path_factory.mktemp("ckpt") / "draft")


@pytest.fixture
def made(monkeypatch) -> dict[str, list]:
    """Every pool and model the backend makes from now on."""
    record: dict[str, list] = {"pools": [], "models": []}
    init, load = PagedKVCache.__init__, loading.load_model

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        record["pools"].append(self)

    def recording_load(*args, **kwargs):
        weights = load(*args, **kwargs)
        record["models"].append(weights.model)
        return weights

    monkeypatch.setattr(PagedKVCache, "__init__", recording_init)
    monkeypatch.setattr(loading, "load_model", recording_load)
    return record


def config(path: Path, **extra) -> BootstrapConfig:
    return BootstrapConfig(model=str(path), device="cpu", max_num_tokens=64, max_batch_size=4, **extra)


def bootstrap_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("bootstrap")]


def assert_all_released(made: dict[str, list]) -> None:
    assert made["pools"] and all(pool.released for pool in made["pools"])
    assert made["models"] and all(p.is_meta for m in made["models"] for p in m.parameters())
    assert bootstrap_threads() == []


async def test_context_manager_releases_everything_on_exit(llama, made):
    async with bootstrap.executor(config(llama)) as ex:
        [response] = ex.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
        assert response.ok and len(response.token_ids) == 4
        assert ex.worker_running and len(made["pools"]) == 2  # the probe, then the final pool
        assert made["pools"][0].released  # profiling consumed the probe
    assert_all_released(made)


async def test_build_executor_hands_the_executor_over(llama, made):
    ex, report = await bootstrap.build_executor(config(llama))
    assert [row["outcome"] for row in report.stages] == ["ok"] * 7 + ["skipped", "ok"] and report.trace_id
    assert report.stages[7]["id"] == "warmup"  # skipped on the CPU: no CUDA graphs
    assert report.plan["kv_tokens"] == ex.scheduler.kv_cache.stats().capacity_tokens
    assert bootstrap_threads() == ["bootstrap-executor"]  # the pipeline's device thread is gone
    assert ex.generate([[3, 4]], SamplingParams(max_tokens=2))[0].ok
    ex.shutdown()
    assert all(pool.released for pool in made["pools"]) and bootstrap_threads() == []


async def test_draft_model_gets_its_own_pool_sized_by_budget_split(llama, draft_ckpt, made):
    boot = Bootstrap(config(llama, draft_model=str(draft_ckpt)))
    try:
        ex = await boot.build()
        plan = boot.report().plan
        final = boot.pipeline.artifacts["final"]
        assert set(final.pool_bytes) == {"target", "draft"}
        assert plan["pools"]["draft"]["tokens"] == final.handle.pools["draft"].stats().capacity_tokens > 0
        assert plan["pools"]["draft"]["gpu_bytes"] == final.pool_bytes["draft"]
        assert ex.generate([[5, 6]], SamplingParams(max_tokens=3))[0].ok
        assert len(made["models"]) == 2 and len(made["pools"]) == 4  # two probes, two final pools
    finally:
        await boot.aclose()
    assert_all_released(made)


async def test_failure_keeps_the_weights_for_retry_and_aclose_releases_them(llama, made, monkeypatch):
    real = PagedKVCache.from_bytes
    monkeypatch.setattr(
        PagedKVCache, "from_bytes", classmethod(lambda *a, **k: (_ for _ in ()).throw(ValueError("boom")))
    )
    boot = Bootstrap(config(llama))
    try:
        with pytest.raises(StageFailed) as info:
            await boot.build()
        assert info.value.stage == "final_build"
        assert not any(p.is_meta for p in made["models"][0].parameters())  # kept for retry
        monkeypatch.setattr(PagedKVCache, "from_bytes", real)
        ex = await boot.retry()
        assert ex.generate([[1, 2]], SamplingParams(max_tokens=2))[0].ok
        assert len(made["models"]) == 1  # resumed without reloading the weights
    finally:
        await boot.aclose()
    assert_all_released(made)


@pytest.mark.parametrize("where", ["profiling", "final_build"])
async def test_cancellation_mid_stage_rolls_everything_back(where, llama, made, monkeypatch):
    entered, gate = threading.Event(), threading.Event()

    def blocking(real):
        def wait_then_run(*args, **kwargs):
            entered.set()
            gate.wait(30)
            return real(*args, **kwargs)

        return wait_then_run

    if where == "profiling":
        monkeypatch.setattr(native, "run_dummy_requests", blocking(native.run_dummy_requests))
    else:
        monkeypatch.setattr(PagedKVCache, "from_bytes", classmethod(blocking(PagedKVCache.from_bytes.__func__)))
    boot = Bootstrap(config(llama))
    async with anyio.create_task_group() as tg:
        tg.start_soon(boot.build)
        assert await anyio.to_thread.run_sync(entered.wait, 30)
        assert boot.pipeline.status[where].state == "running"
        tg.cancel_scope.cancel()
        gate.set()  # the device thread finishes its step; rollback follows
    assert boot.pipeline.status[where].state == "cancelled"
    await boot.aclose()
    assert_all_released(made)
