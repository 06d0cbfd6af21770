"""The agreement rules of ``bootstrap.pipeline.collective`` and ``bootstrap.capacity.agree``, with
a collective that hands back set outcomes."""

from __future__ import annotations

import pickle

import pytest

from bootstrap.capacity import MemoryProfile
from bootstrap.capacity.agree import conservative_profile
from bootstrap.pipeline.collective import Outcome, RankFailed, RankUnresponsive, agree_attempt, is_retryable
from bootstrap.stages.shrink import ProbeOutOfMemory


class Peers:
    """Rank ``rank`` of two; the other rank's outcome is ``other``."""

    world_size = 2

    def __init__(self, rank: int, other: Outcome) -> None:
        self.rank, self.other = rank, other

    def all_gather(self, value, what):
        return sorted([value, self.other], key=lambda o: o.rank)


def profile(**changes) -> MemoryProfile:
    values = (
        dict(
            total_bytes=100,
            free_before_bytes=80,
            model_bytes=10,
            torch_peak_bytes=30,
            torch_used_bytes=20,
            used_bytes=40,
            probe_kv_bytes=5,
            max_num_tokens=64,
        )
        | changes
    )
    return MemoryProfile(**values)


def test_the_conservative_profile_leaves_the_least_room():
    a, b = profile(torch_peak_bytes=50, free_before_bytes=90), profile(used_bytes=60, torch_used_bytes=15)
    agreed = conservative_profile([a, b])
    assert (agreed.torch_peak_bytes, agreed.free_before_bytes, agreed.used_bytes, agreed.torch_used_bytes) == (
        50,
        80,
        60,
        15,
    )
    assert agreed.peak_bytes >= max(a.peak_bytes, b.peak_bytes)


def test_a_peer_failure_fails_the_attempt_here_with_the_peer_s_error_and_figures():
    oom = ProbeOutOfMemory(
        RuntimeError("CUDA out of memory"), doing="the dummy forward", max_num_tokens=128, probe_tokens=192
    )
    with pytest.raises(RankFailed, match="rank 1 failed: ProbeOutOfMemory") as caught:
        agree_attempt(Peers(0, Outcome(1, error=pickle.dumps(oom))), "profiling", profile(), None, conservative_profile)
    assert (caught.value.error.max_num_tokens, caught.value.error.probe_tokens) == (128, 192)
    assert is_retryable(caught.value, lambda e: isinstance(e, ProbeOutOfMemory))


def test_the_cause_is_named_not_the_peer_left_waiting_and_it_is_not_retried():
    lost = RankUnresponsive([1], "stage 'profiling'", "Connection closed by peer")
    oom = pickle.dumps(MemoryError("out of memory"))
    with pytest.raises(RankFailed, match="rank 1 failed: MemoryError") as caught:
        agree_attempt(Peers(0, Outcome(1, error=oom)), "profiling", None, lost, None)
    assert caught.value.peers_lost and not is_retryable(caught.value, lambda e: True)


def test_all_ranks_ok_agree_on_one_artifact():
    assert (
        agree_attempt(
            Peers(1, Outcome(0, artifact=profile(model_bytes=12))), "p", profile(), None, conservative_profile
        ).model_bytes
        == 12
    )


def test_the_launcher_passes_its_shutdown_wait_only_to_a_torch_that_takes_it():
    """torch 2.11's ``LaunchConfig`` has no ``shutdown_timeout``: passing it raised a TypeError on
    the first two-GPU run."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    from bootstrap.parallel.launch import SHUTDOWN_S, _shutdown_timeout

    @dataclasses.dataclass
    class Older:
        min_nodes: int = 1

    assert _shutdown_timeout(Older) == {}
    has = "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}
    assert _shutdown_timeout(LaunchConfig) == ({"shutdown_timeout": SHUTDOWN_S} if has else {})
    assert Older(**_shutdown_timeout(Older)) == Older()
