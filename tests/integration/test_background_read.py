"""A checkpoint's weights are read in a thread of their own while ``final_build`` and
``warmup`` run (a capture needs the parameters' addresses, not their values), and every stage
that needs the values waits for them: the answer equals a start that read first; a read that
fails once is read again by the waiting stage; one that fails twice fails that stage, named."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
from helpers.tiny_models import save_checkpoint

from bootstrap.api import Bootstrap
from bootstrap.backends.native.backend import NativeBackend
from bootstrap.config import BootstrapConfig
from bootstrap.engine.models import weights as weights_module
from bootstrap.engine.sampling.sampler import SamplingParams
from bootstrap.pipeline import StageFailed

BOUND_S = 60.0  # a deadlock guard only: nothing here waits near it


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


def config(path: Path, plans: Path | None = None) -> BootstrapConfig:
    return BootstrapConfig(model=str(path), device="cpu", max_num_tokens=64, max_batch_size=4, plan_cache=plans)


def greedy(executor) -> list[int]:
    rid = executor.enqueue([1, 7, 9, 4], SamplingParams(max_tokens=8, ignore_eos=True))
    return list(executor.await_response(rid, BOUND_S).token_ids)


async def tokens(path: Path, plans: Path | None = None) -> list[int]:
    boot = Bootstrap(config(path, plans))
    try:
        return greedy(await boot.build())
    finally:
        await boot.aclose()


def test_the_pools_are_built_while_the_weights_are_still_read(llama, tmp_path, monkeypatch):
    """With a cached plan (no probe to run first), the read holds until ``final_build`` has run:
    a start that read before building would never get there (the guard's bound fails it)."""
    expected = anyio.run(tokens, llama, tmp_path)  # measures the plan and caches it
    built = threading.Event()
    read, build_final = weights_module.WeightReads.read, NativeBackend.build_final

    def read_after_the_build(self, *args, **kwargs):
        assert built.wait(BOUND_S), "final_build never ran while the weights were read"
        return read(self, *args, **kwargs)

    def building(self, *args, **kwargs):
        final = build_final(self, *args, **kwargs)
        built.set()
        return final

    monkeypatch.setattr(weights_module.WeightReads, "read", read_after_the_build)
    monkeypatch.setattr(NativeBackend, "build_final", building)
    assert anyio.run(tokens, llama, tmp_path) == expected and built.is_set()


def test_a_read_that_fails_once_is_read_again_by_the_stage_that_waits(llama, monkeypatch):
    expected = anyio.run(tokens, llama)
    read, failures = weights_module.WeightReads.read, []

    def failing_once(self, *args, **kwargs):
        if not failures:
            failures.append(1)
            raise OSError("the disk hiccuped")
        return read(self, *args, **kwargs)

    monkeypatch.setattr(weights_module.WeightReads, "read", failing_once)
    assert anyio.run(tokens, llama) == expected and failures == [1]


def test_a_read_that_fails_twice_fails_the_waiting_stage_with_its_cause(llama, monkeypatch):
    def failing(self, *args, **kwargs):
        raise OSError("the disk is gone")

    monkeypatch.setattr(weights_module.WeightReads, "read", failing)
    with pytest.raises(StageFailed, match="the disk is gone") as failed:
        anyio.run(tokens, llama)
    assert failed.value.stage in ("estimation_build", "scheduler_sampler")
    assert not [t for t in threading.enumerate() if t.name == "bootstrap-weights-read"]


def test_the_read_s_own_seconds_and_bytes_are_on_the_waiting_attempt_s_span(llama, tmp_path):
    import json

    async def traced() -> None:
        boot = Bootstrap(config(llama), trace_file=tmp_path / "trace.jsonl")
        try:
            await boot.build()
        finally:
            await boot.aclose()

    anyio.run(traced)
    spans = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    waits = [s["attributes"] for s in spans if "bootstrap.weights.target.read_s" in s["attributes"]]
    assert waits and waits[0]["bootstrap.weights.target.read_bytes"] > 0
    assert 0 <= waits[0]["bootstrap.weights.target.compile_wait_s"] <= waits[0]["bootstrap.weights.target.read_s"]
    assert waits[0]["bootstrap.stage"] == "estimation_build"  # the first stage that needs the values
