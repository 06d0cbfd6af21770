"""The adaptation two stages share after an OOM: halve the ``max_num_tokens`` that actually ran
(never below the batch size), as a new config copy; the shared config is never touched."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bootstrap.artifacts import EstimationBuild
from bootstrap.config import BootstrapConfig
from bootstrap.stage import Adaptation, GiveUp


def halve_max_num_tokens(exc: BaseException, inputs: Mapping[str, Any]) -> Adaptation:
    config: BootstrapConfig = inputs["config"]
    floor = max(config.max_batch_size, 16)
    old = effective_max_num_tokens(config, inputs.get("estimation"))
    new = max(old // 2, floor)
    if new >= old:
        raise GiveUp(
            f"max_num_tokens is already {old}, its floor (max_batch_size, at least 16), and the dummy "
            f"workload still runs out of memory; lower max_batch_size or max_seq_len, or free device memory"
        ) from exc
    return Adaptation({"config": config.model_copy(update={"max_num_tokens": new})}, {"max_num_tokens": f"{old} -> {new}"})


def effective_max_num_tokens(config: BootstrapConfig, estimation: EstimationBuild | None) -> int:
    """The config's value, or the smaller one the probe was built for after its own retries."""
    probe = estimation.max_num_tokens if estimation is not None else config.max_num_tokens
    return min(config.max_num_tokens, probe)
