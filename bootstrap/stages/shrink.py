"""The adaptation two stages share after an OOM: halve ``max_num_tokens`` (never below the
batch size), as a new config copy; the shared config is never touched."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bootstrap.config import BootstrapConfig
from bootstrap.stage import Adaptation


class CannotShrink(RuntimeError):
    """max_num_tokens is already at its floor; the OOM cannot be adapted away."""


def halve_max_num_tokens(exc: BaseException, inputs: Mapping[str, Any]) -> Adaptation:
    config: BootstrapConfig = inputs["config"]
    floor = max(config.max_batch_size, 16)
    old = config.max_num_tokens
    new = max(old // 2, floor)
    if new == old:
        raise CannotShrink(
            f"max_num_tokens is already {old}, its floor (max_batch_size, at least 16), and the dummy "
            f"workload still runs out of memory; lower max_batch_size or max_seq_len, or free device memory"
        ) from exc
    return Adaptation({"config": config.model_copy(update={"max_num_tokens": new})}, {"max_num_tokens": f"{old} -> {new}"})
