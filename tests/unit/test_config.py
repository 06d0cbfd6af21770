"""BootstrapConfig: bad values fail at the edge, each naming its field and the allowed range."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from bootstrap.config import BootstrapConfig, ConfigError, is_int


@pytest.mark.parametrize(
    "values, message",
    [
        ({"max_batch_size": 0}, "max_batch_size: Input should be greater than or equal to 1"),
        ({"max_batch_size": 4096}, "max_num_tokens: must be >= max_batch_size (4096)"),
        ({"tokens_per_block": 48}, "tokens_per_block: must be a power of two in [1, 1024] (got 48)"),
        ({"free_gpu_memory_fraction": 0}, "free_gpu_memory_fraction: Input should be greater than 0"),
        ({"free_gpu_memory_fraction": 1.5}, "free_gpu_memory_fraction: Input should be less than or equal to 1"),
        ({"cross_kv_cache_fraction": 1.0}, "cross_kv_cache_fraction: Input should be less than 1"),
        ({"device": "tpu"}, "device: String should match pattern"),
        ({"dtype": "int4"}, "dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"),
        ({"max_seq_len": 1}, "max_seq_len: Input should be greater than or equal to 2"),
        ({"maxbatch": 3}, "maxbatch: Extra inputs are not permitted"),
    ],
)
def test_bad_values_name_the_field_and_range(values, message):
    with pytest.raises(ConfigError) as info:
        BootstrapConfig.parse(**values)
    assert message in str(info.value)


def test_every_bad_field_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        BootstrapConfig.parse(max_batch_size=0, tokens_per_block=3)
    assert "max_batch_size" in str(info.value) and "tokens_per_block" in str(info.value)


VALID = {
    "model": "qwen3-8b",
    "device": "cpu",
    "dtype": "float16",
    "kv_cache_dtype": "fp8",
    "max_batch_size": 8,
    "max_num_tokens": 2048,
    "max_seq_len": 1024,
    "tokens_per_block": 16,
    "free_gpu_memory_fraction": 0.5,
    "max_kv_bytes": 1 << 30,
    "max_kv_tokens": 1000,
    "host_cache_bytes": 1 << 30,
    "draft_model": "smollm2-135m",
    "cross_kv_cache_fraction": 0.5,
    "tensor_parallel_size": 2,
    "plan_cache": "/tmp/plans",
    "backend": "trtllm",
    "kv_manager": "auto",
    "kv_headroom_bytes": 1 << 30,
    "cuda_graphs": False,
    "prefix_caching": False,
    "overlap": False,
    "quantization": "fp8",
    "cuda_graph_batch_sizes": (1, 2),
    "num_speculative_tokens": 3,
}
NEEDS = {"num_speculative_tokens": {"draft_model": "smollm2-135m"}}  # a field valid only with another


@pytest.mark.parametrize("field", sorted(BootstrapConfig.model_fields))
def test_config_is_frozen_even_for_a_valid_value(field):
    config = BootstrapConfig.parse(max_num_tokens=4096)
    before = getattr(config, field)
    BootstrapConfig.parse(**{field: VALID[field]}, **NEEDS.get(field, {}))  # the value itself is valid
    with pytest.raises(ValidationError) as info:
        setattr(config, field, VALID[field])
    assert [e["type"] for e in info.value.errors()] == ["frozen_instance"]
    assert getattr(config, field) == before


def test_copies_do_not_touch_the_original():
    config = BootstrapConfig.parse(max_num_tokens=4096)
    smaller = config.model_copy(update={"max_num_tokens": 2048})
    assert (config.max_num_tokens, smaller.max_num_tokens) == (4096, 2048)


@given(batch=st.integers(1, 4096), tokens=st.integers(16, 1 << 20))
def test_batch_and_token_limits_are_consistent(batch, tokens):
    if batch <= tokens:
        assert BootstrapConfig.parse(max_batch_size=batch, max_num_tokens=tokens).max_batch_size == batch
    else:
        with pytest.raises(ConfigError, match="max_num_tokens"):
            BootstrapConfig.parse(max_batch_size=batch, max_num_tokens=tokens)


def test_kv_headroom_bytes_replaces_the_fraction_and_both_at_once_is_an_error():
    assert BootstrapConfig.parse().kv_headroom_bytes is None
    assert BootstrapConfig.parse(kv_headroom_bytes=2**30).kv_headroom_bytes == 2**30
    with pytest.raises(ConfigError, match="give one of them"):
        BootstrapConfig.parse(kv_headroom_bytes=2**30, free_gpu_memory_fraction=0.9)
    with pytest.raises(ConfigError, match="kv_headroom_bytes: Input should be greater than or equal to 0"):
        BootstrapConfig.parse(kv_headroom_bytes=-1)


def test_speculative_tokens_default_to_4_with_a_draft_and_need_one():
    assert BootstrapConfig.parse(draft_model="d").speculative_tokens == 4
    assert BootstrapConfig.parse(draft_model="d", num_speculative_tokens=7).speculative_tokens == 7
    assert BootstrapConfig.parse().speculative_tokens == 0
    assert BootstrapConfig.parse(draft_model="d", num_speculative_tokens="auto").speculative_tokens == 8  # its ceiling
    with pytest.raises(ConfigError, match="num_speculative_tokens needs a draft_model"):
        BootstrapConfig.parse(num_speculative_tokens=2)
    for bad in (17, 0, "often", True):
        with pytest.raises(ConfigError, match=r"num_speculative_tokens: must be an integer in \[1, 16\] or 'auto'"):
            BootstrapConfig.parse(draft_model="d", num_speculative_tokens=bad)


class _Count(int):
    """An int subclass that is no bool: still an integer."""


@pytest.mark.parametrize("value", [0, 1, -3, 2**70, _Count(5)])
def test_is_int_accepts_an_int(value):
    assert is_int(value) is True


@pytest.mark.parametrize("value", [True, False, 1.0, 2.5, float("nan"), "3", b"3", None, [1], 3 + 0j])
def test_is_int_refuses_a_bool_and_anything_not_an_int(value):
    assert is_int(value) is False
