"""SimBackend on a FakeDevice: each method allocates what it says, every undo releases it to
zero, injected OOMs fail the right stage cleanly, and the activation model behaves."""

from __future__ import annotations

import itertools

import pytest

from bootstrap.backends.activations import CUBLAS_WORKSPACE_BYTES, activation_peak, sampler_state_bytes
from bootstrap.backends.sim.backend import SimBackend, SimExecutor, rank_weight_bytes
from bootstrap.backends.sim.gpus import sim_device
from bootstrap.capacity import estimation_tokens, plan_capacity
from bootstrap.capacity.presets import preset_shape
from bootstrap.capacity.split import split_budgets
from bootstrap.config import BootstrapConfig
from bootstrap.devices import DeviceOutOfMemory
from bootstrap.pipeline.undo import Undo
from bootstrap.stages.estimation_build import estimation_build
from bootstrap.stages.resolve_classes import resolve_classes

LLAMA = dict(model="llama-3.1-8b", max_seq_len=8192, max_num_tokens=8192, max_batch_size=64)


class Chain:
    """Runs the backend methods in stage order, one Undo per stage, like the pipeline does."""

    def __init__(self, gpu: str = "h100-80gb", **overrides) -> None:
        self.device = sim_device(gpu)
        self.backend = SimBackend(self.device)
        self.config = BootstrapConfig.parse(**{**LLAMA, **overrides})
        self.resolved = resolve_classes(self.config, self.backend)
        self.undos: dict[str, Undo] = {}

    def undo(self, stage: str) -> Undo:
        return self.undos.setdefault(stage, Undo())

    def load(self):
        self.loaded = self.backend.load_model(self.config, self.resolved, self.undo("load_model"))
        return self.loaded

    def estimate(self):
        c = self.config
        self.requested_probe = estimation_tokens(
            max_num_tokens=c.max_num_tokens,
            max_seq_len=self.resolved.max_seq_len,
            max_batch_size=c.max_batch_size,
            tokens_per_block=c.tokens_per_block,
        )
        undo = self.undo("estimation_build")
        self.estimation = estimation_build(
            c, self.resolved, self.loaded, self.backend, None, undo
        )  # the stage caps the probe
        return self.estimation

    def profile(self):
        undo = self.undo("profiling")
        tokens = self.config.max_num_tokens
        self.profile_ = self.backend.profile(self.estimation, self.loaded, tokens, self.config, undo)
        self.release("estimation_build")  # profiling consumes the probe
        return self.profile_

    def final(self):
        c, r = self.config, self.resolved
        self.plan = plan_capacity(
            self.profile_,
            cost=r.total_cost,
            fraction=r.memory_rule.fraction,
            max_seq_len=r.max_seq_len,
            max_batch_size=c.max_batch_size,
            tokens_per_block=c.tokens_per_block,
        )
        self.budgets = split_budgets(self.plan, target_cost=r.cost, draft_cost=r.draft_cost)
        self.final_ = self.backend.build_final(self.loaded, r, self.budgets, self.undo("final_build"))
        return self.final_

    def start(self) -> SimExecutor:
        undo = self.undo("scheduler_sampler")
        return self.backend.start_executor(self.loaded, self.resolved, self.final_, self.plan, self.config, undo)

    def release(self, stage: str) -> None:
        assert self.undos.pop(stage).run() == []

    def release_all(self) -> None:
        for stage in reversed(list(self.undos)):
            self.release(stage)

    def tagged(self, prefix: str) -> int:
        return sum(n for tag, n in self.device.live().items() if tag.startswith(prefix))


STEPS = ("load", "estimate", "profile", "final", "start")
STAGE_OF = dict(zip(STEPS, ("load_model", "estimation_build", "profiling", "final_build", "scheduler_sampler")))


def test_llama_8b_bf16_weights_are_exact_and_released():
    chain = Chain()
    loaded = chain.load()
    assert chain.resolved.dtype == "bfloat16"
    assert loaded.weight_bytes == 16_060_522_496
    assert chain.device.live() == {"load_model/weights": 16_060_522_496}
    chain.release_all()
    assert chain.device.live() == {} and chain.device.allocated_bytes() == 0


def test_tensor_parallel_and_draft_weights_are_per_rank():
    chain = Chain(model="llama-3.1-70b", draft_model="llama-3.1-8b", tensor_parallel_size=4)
    loaded = chain.load()
    target, draft = preset_shape("llama-3.1-70b").weight_bytes(2), 16_060_522_496
    live = chain.device.live()
    assert live["load_model/weights"] == -(-target // 4)
    assert live["load_model/draft_weights"] == draft // 4
    assert loaded.weight_bytes == live["load_model/weights"] + live["load_model/draft_weights"]
    chain.release_all()
    assert chain.device.live() == {}


def test_float32_weights_cost_twice_bfloat16():
    shape = preset_shape("smollm2-135m")
    assert rank_weight_bytes(shape, 4, 1) == 2 * rank_weight_bytes(shape, 2, 1) == 4 * shape.parameter_count()


def test_estimation_allocates_block_aligned_probe_and_workspace():
    chain = Chain()
    chain.load()
    est = chain.estimate()
    tpb = chain.config.tokens_per_block
    assert est.probe_tokens == chain.requested_probe and est.probe_tokens % tpb == 0
    assert est.probe_kv_bytes == chain.resolved.total_cost.bytes_for_tokens(est.probe_tokens)
    assert chain.device.live()["estimation_build/probe_kv"] == est.probe_kv_bytes
    assert chain.device.live()["estimation_build/workspace"] >= sampler_state_bytes(64, 128256)
    assert est.max_num_tokens == chain.config.max_num_tokens
    chain.release("estimation_build")
    assert set(chain.device.live()) == {"load_model/weights"}
    chain.release_all()
    assert chain.device.live() == {}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"max_batch_size": 1024, "max_seq_len": 2048},
        {"model": "llama-3.1-70b", "draft_model": "llama-3.1-8b", "tensor_parallel_size": 4},
    ],
)
def test_estimation_overhead_is_what_the_build_allocates_beside_the_probe(overrides):
    chain = Chain(**overrides)
    chain.load()
    live = chain.device.live()
    overhead = chain.backend.estimation_overhead_bytes(chain.resolved, chain.config)
    assert chain.device.live() == live  # reporting allocates nothing
    chain.estimate()
    assert chain.device.live()["estimation_build/workspace"] == overhead
    chain.release_all()
    assert chain.device.live() == {}


def test_a_sliding_window_probe_is_priced_per_token_in_every_layer():
    chain = Chain(model="gemma-2-9b", max_seq_len=8192, max_num_tokens=2048, max_batch_size=32)
    chain.load()
    est = chain.estimate()
    probe = chain.resolved.probe_cost(tp=1, max_batch_size=32)
    assert probe.intercept == 0 and chain.resolved.total_cost.intercept > 0
    assert est.probe_kv_bytes == probe.bytes_for_tokens(est.probe_tokens) == 9216 * 42 * 8192
    chain.release_all()


def test_profile_reports_real_measurement_semantics():
    chain = Chain()
    chain.load()
    est = chain.estimate()
    before = chain.device.allocated_bytes()
    profile = chain.profile()
    forward = chain.backend.activations(chain.loaded, chain.config.max_num_tokens).total
    assert profile.total_bytes == chain.device.total_bytes()
    assert profile.torch_peak_bytes == before + forward
    assert profile.torch_used_bytes == before
    assert profile.used_bytes - profile.torch_used_bytes == chain.device.non_torch  # CUDA context
    assert profile.model_bytes == before - est.probe_kv_bytes
    assert profile.activation_bytes == forward
    assert profile.probe_kv_bytes == est.probe_kv_bytes and profile.max_num_tokens == 8192
    assert chain.tagged("profiling") == 0  # the forward's memory is gone once measured
    chain.release_all()
    assert chain.device.live() == {}


def test_final_pools_and_executor_allocate_what_the_budgets_say():
    chain = Chain(model="llama-3.1-70b", draft_model="llama-3.1-8b", tensor_parallel_size=4)
    for step in ("load", "estimate", "profile"):
        getattr(chain, step)()
    final = chain.final()
    live = chain.device.live()
    for pool in chain.budgets.pools():
        assert live[f"final_build/kv_{pool.name}"] == pool.gpu_bytes == final.pool_bytes[pool.name]
        assert final.pool_tokens[pool.name] == pool.tokens
    assert set(final.pool_bytes) == {"target", "draft"}
    executor = chain.start()
    assert executor.is_running and executor.stats["requests_completed"] == 1
    assert chain.device.live()["scheduler_sampler/sampler"] == sampler_state_bytes(64, 128256)
    chain.release("scheduler_sampler")
    assert not executor.is_running and chain.tagged("scheduler_sampler") == 0
    chain.release_all()
    assert chain.device.live() == {}


def test_executor_shutdown_then_undo_frees_once():
    chain = Chain()
    for step in STEPS[:-1]:
        getattr(chain, step)()
    executor = chain.start()
    executor.shutdown()
    assert chain.tagged("scheduler_sampler") == 0
    chain.release_all()  # the undo's releases run again: no double free
    assert chain.device.live() == {}
    with pytest.raises(RuntimeError, match="shut down"):
        executor.serve_smoke_request(prompt_tokens=1, tokens_per_block=32)


@pytest.mark.parametrize("failing", STEPS)
def test_injected_oom_fails_that_stage_and_its_undo_leaves_nothing(failing):
    chain = Chain()
    for step in STEPS[: STEPS.index(failing)]:
        getattr(chain, step)()
    stage = STAGE_OF[failing]
    chain.device.inject_oom(stage, 1)
    with pytest.raises(DeviceOutOfMemory, match="injected"):
        getattr(chain, failing)()
    chain.undo(stage).run()
    assert chain.tagged(stage) == 0
    chain.release_all()
    assert chain.device.live() == {}


def test_profiling_ooms_when_the_forward_does_not_fit():
    chain = Chain(gpu="custom:17GiB", model="llama-3.1-8b", max_seq_len=4096, max_num_tokens=65536)
    chain.load()
    chain.estimate()
    with pytest.raises(DeviceOutOfMemory, match="profiling/activations"):
        chain.profile()
    chain.undo("profiling").run()
    chain.release_all()
    assert chain.device.live() == {}


@pytest.mark.parametrize("model", ["llama-3.1-8b", "mixtral-8x7b", "deepseek-v2-lite", "gemma-2-9b", "smollm2-135m"])
def test_activation_peak_grows_with_max_num_tokens(model):
    shape = preset_shape(model)
    peaks = [
        activation_peak(shape, max_num_tokens=t, max_seq_len=4096, dtype_bytes=2).total
        for t in (16, 256, 1024, 4096, 8192, 32768)
    ]
    assert all(a < b for a, b in itertools.pairwise(peaks))
    assert peaks[0] > CUBLAS_WORKSPACE_BYTES


def test_activation_terms_follow_the_documented_formulas():
    shape = preset_shape("llama-3.1-8b")
    t, b = 4096, 2
    est = activation_peak(shape, max_num_tokens=t, max_seq_len=1025, dtype_bytes=b)
    h, nh, nkv, d, i = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size
    assert est.terms["stream"] == 3 * t * h * b + 2 * t * d * b + 8 * t
    assert est.terms["mlp"] == 3 * t * i * b + t * h * b
    assert est.terms["mixer"] == t * (2 * nh + 3 * nkv) * d * b + t * nh * d * b + t * h * b + t * nh * 4
    assert est.terms["logits"] == 4 * shape.vocab_size * 4  # 4096 tokens in requests of 1024
    assert est.total == est.terms["stream"] + est.terms["mlp"] + CUBLAS_WORKSPACE_BYTES


@pytest.mark.parametrize(
    ("model", "tokens", "measured"),
    [("llama-3.1-8b", 8192, 977_338_368), ("qwen3-8b", 4096, 438_337_536), ("gemma-2-9b", 8192, 1_015_087_104)],
)
def test_activation_model_reproduces_h200_measurements(model, tokens, measured):
    """torch.cuda.max_memory_allocated over one transformers 5.17 bf16 forward on an H200 (see the
    activations module docstring), workspace already allocated."""
    est = activation_peak(preset_shape(model), max_num_tokens=tokens, max_seq_len=tokens + 1, dtype_bytes=2)
    assert est.total - CUBLAS_WORKSPACE_BYTES == measured


def test_sliding_window_mask_appears_once_tokens_reach_the_window():
    shape = preset_shape("gemma-2-9b")
    window = min(w for w in shape.attention_windows if w is not None)
    below, at = (
        activation_peak(shape, max_num_tokens=t, max_seq_len=t + 1, dtype_bytes=2) for t in (window - 1, window)
    )
    assert at.terms["stream"] - below.terms["stream"] > window * window


def test_tensor_parallel_shards_the_activation_terms():
    shape = preset_shape("llama-3.1-70b")
    one = activation_peak(shape, max_num_tokens=8192, max_seq_len=8192, dtype_bytes=2, tp=1)
    four = activation_peak(shape, max_num_tokens=8192, max_seq_len=8192, dtype_bytes=2, tp=4)
    h = shape.hidden_size
    assert (four.terms["mlp"] - 8192 * h * 2) * 4 == one.terms["mlp"] - 8192 * h * 2
    assert four.terms["stream"] == one.terms["stream"]  # the residual stream is replicated
    assert four.total < one.total


def test_moe_activations_count_routed_copies_and_router_logits():
    shape = preset_shape("mixtral-8x7b")
    t, b, k = 1024, 2, shape.experts_per_token
    est = activation_peak(shape, max_num_tokens=t, max_seq_len=4096, dtype_bytes=b)
    h = shape.hidden_size
    routed = t * k * h * b + 4 * t * k * shape.moe_intermediate_size * b + t * h * b
    assert est.terms["mlp"] == t * shape.num_experts * 4 + routed


def test_bad_inputs_are_rejected_before_allocating():
    chain = Chain()
    chain.load()
    with pytest.raises(ValueError, match="probe_tokens"):
        chain.backend.build_estimation(chain.loaded, chain.resolved, 0, chain.config, Undo())
    with pytest.raises(ValueError, match="max_num_tokens"):
        activation_peak(chain.resolved.shape, max_num_tokens=0, max_seq_len=8, dtype_bytes=2)
    assert set(chain.device.live()) == {"load_model/weights"}
    chain.release_all()
