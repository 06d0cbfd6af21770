"""How ``run`` meets SIGTERM and SIGHUP (``bootstrap.cli.stops``), in this process: held outside a
stop window, acted on inside one once the work has unwound, and held again after it."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from bootstrap.cli.stops import Stopped, held_stops, until_stopped


def test_outside_a_window_sigterm_and_sighup_are_held_not_fatal():
    with held_stops() as held:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGHUP)
        assert held.heard == [signal.SIGTERM, signal.SIGHUP]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back as it was


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_in_a_window_cancels_the_work_and_is_raised_once_it_unwound(sig, capsys):
    unwound = []

    async def work() -> None:
        try:
            os.kill(os.getpid(), sig)
            await anyio.sleep(30)
        finally:
            unwound.append(True)

    with held_stops() as held, pytest.raises(Stopped) as stopped:
        anyio.run(until_stopped, work, lambda: "rolling back profiling", held)
    assert unwound == [True] and stopped.value.status == 128 + sig
    name = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
    assert capsys.readouterr().err == f"bootstrap: {name}: rolling back profiling ...\n"


def test_after_a_window_the_hold_is_back_and_a_late_signal_is_only_noted():
    async def quick() -> str:
        return "done"

    with held_stops() as held:
        assert anyio.run(until_stopped, quick, lambda: "", held) == "done"
        assert signal.getsignal(signal.SIGTERM) == held.note  # not asyncio's default action
        os.kill(os.getpid(), signal.SIGTERM)
        assert held.heard == [signal.SIGTERM]


def test_a_stop_held_before_the_window_means_the_work_never_starts():
    started = []

    async def work() -> None:
        started.append(True)

    with held_stops() as held:
        os.kill(os.getpid(), signal.SIGHUP)
        with pytest.raises(Stopped) as stopped:
            anyio.run(until_stopped, work, lambda: "", held)
    assert started == [] and stopped.value.status == 129


def test_a_quiet_rank_says_nothing_when_stopped(capsys):
    async def work() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        await anyio.sleep(30)

    with held_stops() as held, pytest.raises(Stopped):
        anyio.run(until_stopped, work, lambda: "", held, False)
    assert capsys.readouterr().err == ""


def test_sigterm_keeps_the_held_handler_inside_a_window_too():
    """The loop's receiver takes SIGINT only: SIGTERM is never left at its default action, not
    even for the moment a window opens or closes (asyncio's receiver resets it to SIG_DFL)."""
    seen = []

    async def work() -> None:
        seen.append(signal.getsignal(signal.SIGTERM))

    with held_stops() as held:
        anyio.run(until_stopped, work, lambda: "", held)
        seen.append(signal.getsignal(signal.SIGTERM))
    assert seen == [held.note, held.note]


def test_wait_blocks_until_a_held_stop_arrives_from_another_thread():
    import threading

    with held_stops() as held:
        assert held.wait(0.05) is False  # none came: the wait ends at its timeout
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        assert held.wait(30) is True and held.heard == [signal.SIGTERM]
        timer.join()
        assert held.wait(0) is True  # a stop already heard ends any later wait at once


@pytest.mark.parametrize("first, second", [(signal.SIGHUP, signal.SIGTERM), (signal.SIGTERM, signal.SIGHUP)])
def test_of_two_different_held_signals_the_exit_status_follows_the_first(first, second, capsys):
    async def never() -> None:
        pytest.fail("the work started after a held stop")

    with held_stops() as held:  # both held before the window
        os.kill(os.getpid(), first)
        os.kill(os.getpid(), second)
        with pytest.raises(Stopped) as stopped:
            anyio.run(until_stopped, never, lambda: "", held)
    assert stopped.value.status == 128 + first

    async def work() -> None:  # the second arrives while the first's cancellation unwinds the work
        try:
            os.kill(os.getpid(), first)
            await anyio.sleep(30)
        finally:
            os.kill(os.getpid(), second)

    with held_stops() as held, pytest.raises(Stopped) as stopped:
        anyio.run(until_stopped, work, lambda: "rolling back", held)
    assert stopped.value.status == 128 + first and held.heard == [first, second]
    assert capsys.readouterr().err == f"bootstrap: stopped by {first.name}: rolling back ...\n"
