"""``bootstrap run --tp N``: one process per rank, each running the stages on its device.

Launched by hand (``bootstrap run --tp N``), the command starts N ranks itself
(``bootstrap.parallel.launch``) and exits with rank 0's status (another rank's, when rank 0
succeeded and it did not). Launched by ``torchrun --nproc-per-node N``, each process finds the
launcher's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` and is one rank. Rank 0 prints (progress,
stage table, plan, text, ``--json``, the trace file); the others print nothing but a crash.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bootstrap.capacity.config_json import shape_from_path
from bootstrap.capacity.presets import preset_shape
from bootstrap.capacity.shape import ModelShape, check_tp_split
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.pipeline.process import ProcessTimeline

GRACE_S = 30.0  # beyond the collective timeout, for the ranks to report and release


def needs_launch(config: Any) -> bool:
    """Several ranks asked for, and no launcher started this process as one of them."""
    if config.tensor_parallel_size == 1:
        return False
    from bootstrap.parallel.torch_dist import RankEnv  # imports torch.distributed: only for several ranks

    return RankEnv.from_env() is None


def check_tp_before_launch(config: BootstrapConfig) -> None:
    """What the ranks would refuse in ``resolve_classes`` and ``load_model``, refused before any
    rank starts: a model that ranks cannot load (only a checkpoint directory and the default
    model shard), or heads and KV heads that ``tensor_parallel_size`` does not divide."""
    check_tp_split(_tp_shape(config.model, config.tensor_parallel_size), config.tensor_parallel_size,
                   shard_kv_heads=config.backend == "native")  # fmt: skip


def _tp_shape(model: str, tp: int) -> ModelShape:
    default = BootstrapConfig.model_fields["model"].default
    if model == default:
        return preset_shape(default)
    if Path(model).expanduser().is_dir():
        return shape_from_path(model)
    raise ConfigError(f"model: tensor_parallel_size {tp} needs a checkpoint directory or {default!r} (got "
                      f"{model!r}: other sources load on one rank only); allowed at tensor_parallel_size 1")  # fmt: skip


def launch_ranks(args: argparse.Namespace, tp: int, main: Callable[[argparse.Namespace], int]) -> int:
    """Start ``tp`` ranks of ``main(args)``; the exit status the command reports."""
    from bootstrap.parallel.launch import launch

    codes = launch(main, (args,), tp, grace_s=args.dist_timeout + GRACE_S)
    return codes[0] or next((c for c in codes if c), 0)


def rank_backend(config: Any, args: argparse.Namespace) -> Any:
    """This rank's native backend, joined to the others (timeout ``--dist-timeout``); sets
    ``args.rank`` so the quiet ranks stay quiet. None on one rank (the default backend)."""
    if config.tensor_parallel_size == 1 or config.backend != "native":
        return None
    from bootstrap.backends.native import NativeBackend
    from bootstrap.backends.native_placement import rank_device, rank_env
    from bootstrap.parallel.torch_dist import init_ranks

    env = rank_env(config)
    args.rank = env.rank
    args.process = ProcessTimeline()  # this rank's own process, from its spawn
    kind = "cuda" if rank_device(config.device, env.local_rank).startswith("cuda") else "cpu"
    with args.process.phase("backend", **{"bootstrap.rank": env.rank}):
        return NativeBackend.for_config(config, collective=init_ranks(env, kind, args.dist_timeout))


def leave() -> None:
    """Leave the process groups, if this process joined any."""
    import sys

    if "bootstrap.parallel.torch_dist" in sys.modules:
        from bootstrap.parallel.torch_dist import leave_ranks

        leave_ranks()
