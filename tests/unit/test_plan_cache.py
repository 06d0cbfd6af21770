"""Plan cache on the simulated backend: a cached profile is reused only for the exact setup it
was measured for (the model by its shape, however its config was read); an entry that cannot be
used, or a store that fails, costs a profiling run and one warning, never the start."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bootstrap.api import make_pipeline
from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.capacity.presets import preset_config
from bootstrap.config import BootstrapConfig
from bootstrap.pipeline import Pipeline
from bootstrap.pipeline.telemetry import make_tracer_provider
from bootstrap.stages import DEFAULT_STAGES
from bootstrap.stages.plan_cache import PlanCache, fingerprint
from bootstrap.stages.resolve_classes import resolve_classes

BASE = dict(model="llama-3.1-8b", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64)
# One other valid value for every config field the cached profile or plan depends on.
CHANGED = {
    "model": "qwen2.5-7b",
    "draft_model": "llama-3.1-8b",
    "dtype": "float16",
    "kv_cache_dtype": "fp8",
    "quantization": "fp8",
    "max_batch_size": 32,
    "max_num_tokens": 4096,
    "max_seq_len": 4096,
    "tokens_per_block": 64,
    "free_gpu_memory_fraction": 0.8,
    "kv_headroom_bytes": 4 * 1024**3,
    "max_kv_bytes": 20 * 1024**3,
    "max_kv_tokens": 100_000,
    "host_cache_bytes": 1024**3,
    "tensor_parallel_size": 2,
    "backend": "trtllm",
    "cuda_graphs": False,  # the profile measures the graphs' memory on a GPU
    "cuda_graph_batch_sizes": (1, 2),
}
ON_TRTLLM_ONLY = {"kv_manager": "v2"}  # refused with the native backend of BASE
REJECTED_FOR_EVERY_PRESET = {"cross_kv_cache_fraction": 0.25}  # decoder-only models refuse it
# the device enters by name and size; the cache's location, prefix reuse (it reserves nothing) and overlap
# change nothing
IRRELEVANT = {"device", "plan_cache", "prefix_caching", "overlap"}
WITH_A_DRAFT_ONLY = {
    "num_speculative_tokens"
}  # refused without draft_model (BASE has none); fingerprinted all the same


async def start(cache_dir, gpu="h100-80gb", **overrides):
    """One start with the plan cache; returns the profiling stage's span and the device."""
    device, memory = sim_device(gpu), InMemorySpanExporter()
    config = BootstrapConfig.parse(**{**BASE, **overrides}, plan_cache=cache_dir)
    pipeline = make_pipeline(config, SimBackend(device), tracer_provider=make_tracer_provider(memory=memory))
    await pipeline.run()
    await pipeline.aclose()
    (span,) = [s for s in memory.get_finished_spans() if s.name == "bootstrap.stage.profiling"]
    return span.attributes["bootstrap.outcome"]


def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_the_capacity_stage_writes_nothing_the_pipeline_that_made_the_cache_stores_the_plan(tmp_path):
    config = BootstrapConfig.parse(**BASE, plan_cache=tmp_path)
    device = sim_device("h100-80gb")
    inputs = {"config": config, "backend": SimBackend(device), "plan_cache": PlanCache(tmp_path), "releasable_bytes": 0}
    bare = Pipeline(DEFAULT_STAGES, inputs, device=device)  # the stages alone: the cache is read, never written
    await bare.run()
    await bare.aclose()
    assert list(tmp_path.glob("*.json")) == []
    assert await start(tmp_path) == "ok"  # make_pipeline: the plan cache stores the plan after capacity
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_every_config_field_is_either_tested_here_or_known_not_to_matter():
    fields = set(CHANGED) | set(ON_TRTLLM_ONLY) | set(REJECTED_FOR_EVERY_PRESET) | IRRELEVANT | WITH_A_DRAFT_ONLY
    assert set(BootstrapConfig.model_fields) == fields


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A cache holding the plan of one BASE start (the first start profiles, the second reuses)."""
    import anyio

    directory = tmp_path_factory.mktemp("plans")
    assert anyio.run(start, directory) == "ok"
    assert anyio.run(start, directory) == "skipped"
    return directory


@pytest.mark.parametrize("field", sorted(CHANGED))
async def test_a_cached_plan_is_not_reused_when_a_field_changes(warm_cache, field):
    assert await start(warm_cache, **{field: CHANGED[field]}) == "ok"


def test_a_model_s_stored_dtype_is_not_in_its_key_but_every_figure_of_its_shape_is():
    """A .gguf file's config has no dtype, the checkpoint converted from it says float32: one
    model, one plan (the weights load in the resolved dtype, which the key holds either way)."""
    backend = SimBackend(sim_device("h100-80gb"))
    config = BootstrapConfig.parse(**BASE)
    resolved = resolve_classes(config, backend)

    def key(**shape) -> str:
        changed = dataclasses.replace(resolved, shape=dataclasses.replace(resolved.shape, **shape))
        return fingerprint(config, changed, backend.device, backend.name)

    assert key(torch_dtype=None) == key(torch_dtype="float32") == key(torch_dtype="bfloat16")
    others = [
        key(num_kv_heads=4),
        key(vocab_size=resolved.shape.vocab_size + 1),
        key(head_dim=64),
        key(max_position_embeddings=4096),
        key(tie_word_embeddings=True),
    ]
    assert len({key(), *others}) == 1 + len(others)
    draft = dataclasses.replace(resolved, draft_shape=dataclasses.replace(resolved.shape, torch_dtype=None))
    as_converted = dataclasses.replace(draft, draft_shape=resolved.shape)
    assert fingerprint(config, draft, backend.device, "sim") == fingerprint(config, as_converted, backend.device, "sim")


@pytest.mark.parametrize("field", sorted(REJECTED_FOR_EVERY_PRESET))
async def test_a_cached_plan_is_not_found_for_a_field_no_preset_can_use(tmp_path, field):
    backend = SimBackend(sim_device("h100-80gb"))
    config = BootstrapConfig.parse(**BASE, plan_cache=tmp_path)
    await start(tmp_path)
    cache, resolved = PlanCache(tmp_path), resolve_classes(config, backend)
    assert cache.lookup(config, resolved, backend) is not None
    other = config.model_copy(update={field: REJECTED_FOR_EVERY_PRESET[field]})
    assert cache.lookup(other, resolved, backend) is None


@pytest.mark.parametrize("field", sorted(ON_TRTLLM_ONLY))
async def test_a_cached_trtllm_plan_is_not_reused_when_a_trtllm_field_changes(tmp_path, field):
    assert await start(tmp_path, backend="trtllm") == "ok"
    assert await start(tmp_path, backend="trtllm") == "skipped"
    assert await start(tmp_path, backend="trtllm", **{field: ON_TRTLLM_ONLY[field]}) == "ok"


def _truncate(text: str) -> bytes:
    return text[: len(text) // 2].encode()


def _figure(text: str, key: str, value: object) -> bytes:
    data = json.loads(text)
    data["profile"][key] = value
    return json.dumps(data).encode()


UNUSABLE = {
    "truncated": _truncate,
    "not text": lambda text: b"\x89PNG\r\n\x1a\n\x00\xff",
    "not an object": lambda text: b"[1, 2, 3]",
    "a negative figure": lambda text: _figure(text, "torch_peak_bytes", -1),
    "an infinite figure": lambda text: _figure(text, "torch_peak_bytes", 1e400),
    "a budget that is no integer": lambda text: json.dumps({**json.loads(text), "kv_budget_bytes": "lots"}).encode(),
}


@pytest.mark.parametrize("damage", sorted(UNUSABLE))
async def test_an_unusable_entry_is_profiled_again_with_one_warning(tmp_path, caplog, damage):
    await start(tmp_path)
    (entry,) = tmp_path.glob("*.json")
    entry.write_bytes(UNUSABLE[damage](entry.read_text()))
    assert await start(tmp_path) == "ok"
    (warning,) = cache_warnings(caplog)
    assert warning.startswith(f"plan cache: ignoring {entry} (") and warning.endswith("); profiling again")
    assert await start(tmp_path) == "skipped"  # the fresh profile replaced the damaged entry


async def test_an_entry_written_for_another_setup_is_not_trusted(tmp_path, caplog):
    await start(tmp_path)
    (h100,) = tmp_path.glob("*.json")
    await start(tmp_path, gpu="h200")
    (h200,) = set(tmp_path.glob("*.json")) - {h100}
    h100.write_bytes(h200.read_bytes())  # e.g. copied between machines under the wrong name
    assert await start(tmp_path) == "ok"
    (warning,) = cache_warnings(caplog)
    assert f"ignoring {h100} (written for another setup" in warning


async def test_an_entry_that_cannot_be_read_or_replaced_costs_two_warnings_not_the_start(tmp_path, caplog):
    await start(tmp_path)
    (entry,) = tmp_path.glob("*.json")
    entry.unlink()
    (entry / "in-the-way").mkdir(parents=True)  # reading it fails, and so does the rename onto it
    assert await start(tmp_path) == "ok"
    ignored, not_stored = cache_warnings(caplog)
    assert ignored == f"plan cache: ignoring {entry} (Is a directory); profiling again"
    assert not_stored.startswith(f"plan cache: could not store the plan in {tmp_path}: ")
    assert list(tmp_path.glob("*.tmp")) == []  # the temporary file of the failed store is gone


async def test_a_cache_directory_removed_after_the_start_began_is_a_warning(tmp_path, caplog):
    directory = tmp_path / "plans"
    device = sim_device("h100-80gb")
    pipeline = make_pipeline(BootstrapConfig.parse(**BASE, plan_cache=directory), SimBackend(device))
    shutil.rmtree(directory)  # the check at construction passed (and left its marker); the store comes later
    await pipeline.run()
    await pipeline.aclose()
    (warning,) = cache_warnings(caplog)
    assert warning.startswith(f"plan cache: could not store the plan in {directory}")


async def test_a_cached_plan_without_room_now_is_profiled_again_and_the_span_says_why(tmp_path):
    async def estimation_attempt(device) -> dict:
        memory = InMemorySpanExporter()
        config = BootstrapConfig.parse(**BASE, plan_cache=tmp_path)
        pipeline = make_pipeline(config, SimBackend(device), tracer_provider=make_tracer_provider(memory=memory))
        await pipeline.run()
        await pipeline.aclose()
        return next(s for s in memory.get_finished_spans() if s.name == "bootstrap.stage.estimation_build").attributes

    first = await estimation_attempt(sim_device("h100-80gb"))
    assert first["bootstrap.plan_cache.miss"] == "no plan cached for this setup"
    crowded = sim_device("h100-80gb")
    crowded.allocate(20 * 1024**3, "another process")  # the cached 57 GiB budget no longer fits
    again = await estimation_attempt(crowded)
    assert again["bootstrap.plan_cache.miss"].startswith("no room: the cached plan needs ")
    assert "are free" in again["bootstrap.plan_cache.miss"]


async def test_a_plan_measured_while_another_job_held_memory_is_measured_again_once_it_is_gone(tmp_path):
    """A cached plan is a measurement, not a limit: it records what was free when measured, and a
    start with much more room (``MORE_ROOM``) profiles again; a little more reuses it."""

    async def start_on(device) -> tuple[str, str | None, int]:
        memory = InMemorySpanExporter()
        config = BootstrapConfig.parse(**BASE, plan_cache=tmp_path)
        pipeline = make_pipeline(config, SimBackend(device), tracer_provider=make_tracer_provider(memory=memory))
        artifacts = await pipeline.run()
        await pipeline.aclose()
        spans = {s.name: s.attributes for s in memory.get_finished_spans()}
        estimation, profiling = spans["bootstrap.stage.estimation_build"], spans["bootstrap.stage.profiling"]
        return profiling["bootstrap.outcome"], estimation.get("bootstrap.plan_cache.miss"), artifacts["plan"].kv_tokens

    def held(gib: int):
        device = sim_device("h100-80gb")
        device.non_torch += gib * 1024**3  # another process's memory: outside this one's allocator
        return device

    crowded = held(40)
    free_then = crowded.free_bytes()
    outcome, _, crowded_tokens = await start_on(crowded)
    (entry,) = tmp_path.glob("*.json")
    assert outcome == "ok" and json.loads(entry.read_text())["free_bytes"] == free_then
    outcome, miss, tokens = await start_on(sim_device("h100-80gb"))
    assert outcome == "ok" and miss.startswith("more room: the cached plan was measured with ")
    assert tokens > 2 * crowded_tokens
    assert json.loads(entry.read_text())["free_bytes"] == free_then + 40 * 1024**3  # the new measurement
    assert await start_on(held(4)) == ("skipped", None, tokens)  # a little less room: the plan still fits
    outcome, miss, _ = await start_on(sim_device("h100-80gb"))
    assert (outcome, miss) == ("skipped", None)


async def test_two_checkpoints_of_one_shape_with_different_weight_dtypes_never_share_a_plan(tmp_path):
    """The stored dtype is not in the key (``model_key``), but the dtype the weights load in is:
    with ``dtype`` auto a GPU loads each 16-bit checkpoint in its own dtype, so each has its plan."""
    models = {}
    for dtype in ("bfloat16", "float16"):
        folder = tmp_path / dtype
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**preset_config("llama-3.1-8b"), "torch_dtype": dtype}))
        models[dtype] = str(folder)
    plans = tmp_path / "plans"
    assert await start(plans, model=models["bfloat16"]) == "ok"
    assert await start(plans, model=models["float16"]) == "ok"  # measured, not the bfloat16 checkpoint's plan
    assert len(list(plans.glob("*.json"))) == 2
    assert await start(plans, model=models["bfloat16"]) == await start(plans, model=models["float16"]) == "skipped"


def test_the_key_holds_the_dtype_the_weights_load_in():
    """One config, one shape: weights loaded in another dtype (``dtype`` auto follows each
    checkpoint's on a GPU) hold other bytes and activations, so never share a plan."""
    backend = SimBackend(sim_device("h100-80gb"))
    config = BootstrapConfig.parse(**BASE)
    resolved = resolve_classes(config, backend)
    keys = {
        dtype: fingerprint(config, dataclasses.replace(resolved, dtype=dtype), backend.device, backend.name)
        for dtype in ("bfloat16", "float16", "float32")
    }
    assert len(set(keys.values())) == 3
