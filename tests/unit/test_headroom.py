"""``kv_headroom_bytes`` through the whole pipeline on a simulated H200: the budget is what the
measured peak leaves less the headroom (not a fraction of it), the probe leaves the headroom too,
and the plan cache keeps plans of either rule apart."""

from __future__ import annotations

from bootstrap.api import make_pipeline
from bootstrap.backends.sim.backend import SimBackend
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.config import BootstrapConfig
from bootstrap.stages.summary import plan_summary

GIB = 1024**3
BASE = dict(model="llama-3.1-8b", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64)


async def planned(**overrides) -> dict:
    device = sim_device("h200")
    pipeline = make_pipeline(BootstrapConfig.parse(**BASE, **overrides), SimBackend(device))
    try:
        await pipeline.run()
        return plan_summary(pipeline.artifacts)
    finally:
        await pipeline.aclose()
        assert device.live() == {}


async def test_headroom_gives_kv_everything_left_after_the_peak_but_the_headroom():
    plan = await planned(kv_headroom_bytes=4 * GIB)
    profile = plan["profile"]
    left = profile["total_bytes"] - profile["peak_bytes"] + profile["probe_kv_bytes"]
    assert plan["planned_kv_budget_bytes"] == left - 4 * GIB and plan["headroom_bytes"] == 4 * GIB
    tokens = (left - 4 * GIB) // 131072 // 32 * 32
    assert plan["kv_tokens"] == tokens


async def test_a_headroom_below_a_tenth_of_what_is_left_gives_more_kv_than_the_default_fraction():
    default, headroom = await planned(), await planned(kv_headroom_bytes=4 * GIB)
    left = default["profile"]["total_bytes"] - default["profile"]["peak_bytes"] + default["profile"]["probe_kv_bytes"]
    assert 0.1 * left > 4 * GIB
    assert headroom["kv_tokens"] > default["kv_tokens"] and default["headroom_bytes"] is None


async def test_plans_of_the_two_rules_are_cached_apart(tmp_path):
    await planned(plan_cache=tmp_path)
    await planned(plan_cache=tmp_path, kv_headroom_bytes=4 * GIB)
    assert len(list(tmp_path.glob("*.json"))) == 2
