"""On a CUDA device, a checkpoint's weights read in the background (``engine.models.reading``)
while ``warmup`` captures the decode graphs: the graphs, captured over the parameters' addresses
before a byte of them arrived, replay the weights read afterwards, and a start answers the same
tokens as one whose read ended before any graph was captured."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from helpers.tiny_models import save_checkpoint  # noqa: E402

from bootstrap.api import Bootstrap  # noqa: E402
from bootstrap.backends.native.backend import NativeBackend  # noqa: E402
from bootstrap.config import BootstrapConfig  # noqa: E402
from bootstrap.engine.models import weights as weights_module  # noqa: E402
from bootstrap.engine.sampling.sampler import SamplingParams  # noqa: E402

PROMPTS = [[1, 7, 9, 4, 11, 3], [5, 6, 7], [200, 13, 8, 21]]
BOUND_S = 120.0  # a deadlock guard only


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


def config(path: Path, plans: Path) -> BootstrapConfig:
    shape = dict(max_seq_len=256, max_num_tokens=64, max_batch_size=4, max_kv_bytes=1 << 30)
    return BootstrapConfig(model=str(path), device="cuda", dtype="float32", plan_cache=plans, **shape)


async def answers(path: Path, plans: Path) -> tuple[list[list[int]], int]:
    boot = Bootstrap(config(path, plans))
    try:
        executor = await boot.build()
        assert executor.runner.graphs is not None, "no CUDA graphs captured"
        replays: list = []
        replay = executor.runner.graphs.replay
        executor.runner.graphs.replay = lambda bucket: replays.append(bucket) or replay(bucket)
        ids = [executor.enqueue(list(p), SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS]
        return [list(executor.await_response(rid, BOUND_S).token_ids) for rid in ids], len(replays)
    finally:
        await boot.aclose()


def test_graphs_captured_before_the_weights_arrived_replay_the_weights_read_after(llama, tmp_path, monkeypatch):
    expected, _ = anyio.run(answers, llama, tmp_path)  # the probe waits for the read; the plan is cached
    captured = threading.Event()
    read, capture_graphs = weights_module.WeightReads.read, NativeBackend.capture_graphs

    def read_after_the_capture(self, *args, **kwargs):
        assert captured.wait(BOUND_S), "warmup never captured while the weights were read"
        return read(self, *args, **kwargs)

    def capturing(self, *args, **kwargs):
        warmup = capture_graphs(self, *args, **kwargs)
        captured.set()
        return warmup

    monkeypatch.setattr(weights_module.WeightReads, "read", read_after_the_capture)
    monkeypatch.setattr(NativeBackend, "capture_graphs", capturing)
    tokens, replays = anyio.run(answers, llama, tmp_path)
    assert captured.is_set() and replays > 0
    assert tokens == expected
