"""Fixtures for the trtllm backend tests; the setup itself is ``helpers.trtllm_setup``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.trtllm_setup import VERSIONS


@pytest.fixture(params=VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def draft_config(tmp_path: Path) -> Path:
    """A 1B-class Llama draft sharing Llama 3's vocabulary (a Llama-3.2-1B-shaped config.json)."""
    path = tmp_path / "draft" / "config.json"
    path.parent.mkdir()
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 128256,
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_hidden_layers": 16,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 64,
                "max_position_embeddings": 131072,
                "tie_word_embeddings": True,
                "torch_dtype": "bfloat16",
            }
        )
    )
    return path
