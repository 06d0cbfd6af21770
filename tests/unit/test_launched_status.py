"""The status and the one extra line of ``bootstrap run --tp N`` from how its ranks ended
(``bootstrap.cli.tp.launched_status`` over ``bootstrap.parallel.launch.Launched``)."""

from __future__ import annotations

import pytest

from bootstrap.cli.tp import check_rank_count, launched_status
from bootstrap.config import BootstrapConfig, ConfigError
from bootstrap.parallel.launch import Launched

STOPPED = "; the launcher stopped the other ranks"


@pytest.mark.parametrize(
    "launched, status, line",
    [
        (Launched({0: 0, 1: 0}), 0, None),
        (Launched({1: 1}), 1, None),  # an agreed stage failure: rank 0 reports it
        (Launched({0: 2, 1: 2}), 2, None),
        (Launched({}, signal=15), 143, None),  # the launcher's own SIGTERM: every rank said so
        (Launched({}, signal=1), 129, None),
        (Launched({1: -9}), 1, "rank 1 was killed by SIGKILL" + STOPPED),
        (Launched({0: 1, 1: 17}), 1, "rank 1 exited with status 17" + STOPPED),
        (Launched({1: 143}), 143, "rank 1 was stopped by SIGTERM" + STOPPED),
        (Launched({0: 1}, raised={0: "ValueError: a bug"}), 1, "rank 0 raised ValueError: a bug" + STOPPED),
        (Launched({0: 2, 1: -6}), 1, "rank 1 was killed by SIGABRT" + STOPPED),
        # rank 0's own stop (a signal sent to it alone): it said so itself; the launcher stopped the rest
        (Launched({0: 143}), 143, None),
        (Launched({0: 129}), 129, None),
        (Launched({0: 130}), 130, None),
    ],
)
def test_the_status_is_rank_0_s_and_a_rank_it_cannot_speak_for_is_named(launched, status, line):
    assert launched_status(launched) == (status, line)


def test_under_a_launcher_tp_must_be_the_number_of_ranks(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_rank_count(BootstrapConfig(tensor_parallel_size=2))
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: 1, but the launcher started 2 ranks .*pass --tp 2$"):
        check_rank_count(BootstrapConfig())
