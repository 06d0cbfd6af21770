"""``bootstrap run --tp N``: one process per rank, each running the stages on its device.

Launched by hand (``bootstrap run --tp N``), the command starts N ranks itself through torch's
own launcher (``bootstrap.parallel.launch``: ``torchrun --standalone --nproc-per-node N`` as a
function), so ``torchrun --nproc-per-node N -m bootstrap run --tp N ...`` starts the same ranks
with the same environment and each runs the same code. Each process finds the launcher's
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` and is one rank; ``--tp`` must equal ``WORLD_SIZE``.
Rank 0 prints (progress, stage table, plan, text, ``--json``, the trace file); the others print
nothing but a crash. The command's status is rank 0's; when another rank ended first in a way
rank 0 cannot report (killed, crashed, stopped), one more line names it (``launched_status``).
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from typing import Any

from bootstrap.capacity.shape import ModelShape, check_tp_split
from bootstrap.cli.args import shape_on_hand
from bootstrap.cli.exits import BAD_INPUT, HUNG_UP, INTERRUPTED, OK, STAGE_FAILED, TERMINATED
from bootstrap.cli.first_moment import FIRST_MOMENT
from bootstrap.cli.stops import HeldStops
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.parallel.rank_env import RankEnv
from bootstrap.pipeline.process import ProcessTimeline, spawn_time_ns

# Statuses a rank ends with after it reported (or, on ranks > 0, after rank 0 reports the same
# agreed failure): done, a stage failed, bad input, stopped by SIGINT / SIGTERM / SIGHUP.
PEER_REFUSAL_S = 30.0  # how long a rank > 0 waits for rank 0's refusal to end it: torchrun's own grace for a stop
REPORTED = {OK, STAGE_FAILED, BAD_INPUT, INTERRUPTED, TERMINATED, HUNG_UP}
AGREED = {STAGE_FAILED, BAD_INPUT}  # every rank has the same failure, and rank 0 prints it


def needs_launch(config: Any) -> bool:
    """Several ranks asked for, and no launcher started this process as one of them."""
    return config.tensor_parallel_size > 1 and RankEnv.from_env() is None


def this_rank() -> int:
    """This process's rank under a launcher (``torchrun`` or ``bootstrap run --tp N``), else 0."""
    env = RankEnv.from_env()
    return 0 if env is None else env.rank


def check_rank_count(config: BootstrapConfig) -> None:
    """Under a launcher, ``tensor_parallel_size`` is the number of ranks it started: ``torchrun
    --nproc-per-node 2`` with no ``--tp`` would otherwise run two unrelated single-rank runs."""
    env = RankEnv.from_env()
    if env is not None and env.world_size != config.tensor_parallel_size:
        raise ConfigError(
            f"tensor_parallel_size: {config.tensor_parallel_size}, but the launcher started "
            f"{env.world_size} ranks (WORLD_SIZE {env.world_size}); pass --tp {env.world_size}"
        )


def await_rank_0(held: HeldStops) -> int | None:
    """Bad input, found by every rank alike, on a rank > 0: wait (up to ``PEER_REFUSAL_S``) for
    the launcher to stop this rank once rank 0 has said it and ended; had this rank ended first,
    torch's launcher would SIGTERM rank 0 at once, possibly before it can say anything. The
    signal that came, if one did."""
    try:
        return held.heard[0] if held.wait(PEER_REFUSAL_S) else None
    except KeyboardInterrupt:  # the launcher sends a Ctrl-C on: not held
        return signal.SIGINT


def check_tp_before_launch(config: BootstrapConfig) -> None:
    """What the ranks would refuse in ``resolve_classes`` and ``load_model``, refused before any
    rank starts: a model that ranks cannot load (only a checkpoint directory and the default
    model shard), or heads and KV heads that ``tensor_parallel_size`` does not divide."""
    check_tp_split(
        _tp_shape(config.model, config.tensor_parallel_size),
        config.tensor_parallel_size,
        shard_kv_heads=config.backend == "native",
    )


def _tp_shape(model: str, tp: int) -> ModelShape:
    shape = shape_on_hand(model, random=False)
    if shape is not None:
        return shape
    default = BootstrapConfig.model_fields["model"].default
    raise ConfigError(
        f"model: tensor_parallel_size {tp} needs a checkpoint directory or {default!r} (got "
        f"{model!r}: other sources load on one rank only); allowed at tensor_parallel_size 1"
    )


def launch_ranks(
    args: argparse.Namespace, tp: int, main: Callable[[argparse.Namespace], int], signalled: int | None = None
) -> int:
    """Start ``tp`` ranks of ``main(args)`` (the launcher already printed the start line);
    the exit status the command reports, with one line on stderr when ``launched_status`` has one.
    ``signalled``: the status after a stop signal (default 128 + its number; ``serve``: 0)."""
    import sys

    from bootstrap.parallel.launch import launch

    launched = launch(main, (argparse.Namespace(**{**vars(args), "announced": True}),), tp)
    status, line = launched_status(launched, signalled)
    if line:
        print(f"bootstrap: {line}", file=sys.stderr, flush=True)
    return status


def launched_status(launched: Any, signalled: int | None = None) -> tuple[int, str | None]:
    """The command's status from how the ranks ended (``bootstrap.parallel.launch.Launched``),
    and one line to add when rank 0 cannot have said it: a rank raised, was killed, exited with a
    status outside the table, or (a rank > 0) was stopped; the launcher then stopped the rest.
    A crash is status 1; otherwise the status is rank 0's, or the first failed rank's."""
    if launched.signal is not None:  # every rank got the launcher's signal, and rank 0 said so
        return (128 + launched.signal if signalled is None else signalled), None
    codes = launched.codes
    crashed = [r for r, c in sorted(codes.items()) if r in launched.raised or c not in REPORTED]
    unsaid = crashed or [r for r, c in sorted(codes.items()) if r != 0 and c not in AGREED | {OK}]
    status = codes.get(0) or next((c for _, c in sorted(codes.items()) if c), OK)
    if not unsaid:
        return status, None
    line = (
        f"rank {unsaid[0]} {_ended(codes[unsaid[0]], launched.raised.get(unsaid[0]))}; "
        "the launcher stopped the other ranks"
    )
    return (STAGE_FAILED if crashed else status), line


def _ended(code: int, raised: str | None) -> str:
    if raised:
        return f"raised {raised}"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code > 128 and code - 128 in signal.valid_signals():
        return f"was stopped by {signal.Signals(code - 128).name}"
    return f"exited with status {code}"


def rank_backend(config: Any, args: argparse.Namespace) -> Any:
    """This rank's native backend, joined to the others (timeout ``--dist-timeout``). None on one
    rank (the default backend)."""
    if config.tensor_parallel_size == 1 or config.backend != "native":
        return None
    from bootstrap.backends.native.backend import NativeBackend
    from bootstrap.backends.native.placement import rank_device, rank_env
    from bootstrap.parallel.torch_dist import init_ranks

    env = rank_env(config)
    args.process = ProcessTimeline(spawn_time_ns(FIRST_MOMENT))  # this rank's own process, from its start
    kind = "cuda" if rank_device(config.device, env.local_rank).startswith("cuda") else "cpu"
    with args.process.phase("backend", **{"bootstrap.rank": env.rank}):
        return NativeBackend.for_config(config, collective=init_ranks(env, kind, args.dist_timeout))


def leave() -> None:
    """Leave the process groups, if this process joined any."""
    import sys

    if "bootstrap.parallel.torch_dist" in sys.modules:
        from bootstrap.parallel.torch_dist import leave_ranks

        leave_ranks()
