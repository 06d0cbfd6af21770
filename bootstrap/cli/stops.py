"""How ``run`` ends on a signal: SIGINT (Ctrl-C), SIGTERM and SIGHUP all mean "stop".

- During the build or the answer (``until_stopped``): the stop is acknowledged on stderr at once,
  the work is cancelled, its stages roll back, and ``Stopped`` is raised once it has unwound; the
  command exits with 128 + the signal's number (130, 143, 129: the exit table); a second stop
  (Ctrl-C again) is acknowledged too, and waits.
- Before them (checks, imports), SIGTERM and SIGHUP are held (no build starts); SIGINT: ``KeyboardInterrupt``.
- After them, while the run releases the executor and prints its report, SIGTERM and SIGHUP are
  held: torch's launcher stops the other ranks the moment one ends with an error, and that must
  not cut rank 0's report short.

``held_stops`` installs SIGTERM's and SIGHUP's one handler on the main thread: it notes the signal,
and in a window wakes the event loop (``call_soon_threadsafe``) to cancel the work; the loop's own
receiver takes only SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import anyio
from anyio.abc import TaskStatus

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops run and serve (a closed terminal: SIGHUP)
HELD_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """The command was stopped by ``signum``; its work is unwound and rolled back."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def status(self) -> int:
        """The exit status: 128 + the signal's number, as a shell reports a signal."""
        return 128 + self.signum


class HeldStops:
    """SIGTERM and SIGHUP noted instead of acted on; ``raise_if_heard`` acts on the first, and
    ``wake`` (set while a window is open) is called with each one as it arrives."""

    def __init__(self) -> None:
        self.heard: list[int] = []
        self.wake: Callable[[int], None] | None = None
        self._first = threading.Event()

    def note(self, signum: int, frame: object) -> None:
        self.heard.append(signum)
        self._first.set()
        if self.wake is not None:
            self.wake(signum)

    def wait(self, timeout: float) -> bool:
        """Block (not spin) until a held stop arrives or ``timeout`` seconds pass; whether one came."""
        return self._first.wait(timeout)

    def install(self) -> None:
        for sig in HELD_SIGNALS:
            signal.signal(sig, self.note)

    def raise_if_heard(self) -> None:
        if self.heard:
            raise Stopped(self.heard[0])


NOT_HELD = HeldStops()  # off the main thread, or outside a command: nothing is ever noted


def stop_name(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


@contextlib.contextmanager
def held_stops() -> Iterator[HeldStops]:
    """Hold SIGTERM and SIGHUP for the block (on the main thread; elsewhere signals never arrive)."""
    if threading.current_thread() is not threading.main_thread():
        yield NOT_HELD
        return
    held, before = HeldStops(), {sig: signal.getsignal(sig) for sig in HELD_SIGNALS}
    held.install()
    try:
        yield held
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


async def until_stopped(
    work: Callable[[], Awaitable[T]], doing: Callable[[], str], held: HeldStops = NOT_HELD, speak: bool = True
) -> T:
    """``work()``, cancelled by SIGINT, SIGTERM or SIGHUP: the stop is acknowledged on stderr at
    once (with ``doing()``: what happens now; unless not ``speak``, as on the quiet ranks), and
    raised as ``Stopped`` once ``work`` has unwound, its stages rolled back. A stop held before
    the window means ``work`` never starts. A later stop while ``work`` unwinds (a second Ctrl-C
    included) is only acknowledged again: what is in flight cannot be cut short."""
    held.raise_if_heard()
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return await work()
    if held is NOT_HELD:
        with held_stops() as own:
            return await until_stopped(work, doing, own, speak)
    heard: list[int] = []
    finished: list[T] = []
    raised: list[Exception] = []
    work_scope, unwound = anyio.CancelScope(), list[bool]()

    async with anyio.create_task_group() as tg:

        def stop(signum: int) -> None:
            if finished or raised or unwound:
                return
            if speak:
                again = " again: still" if heard else ":"
                print(f"bootstrap: {stop_name(signum)}{again} {doing()} ...", file=sys.stderr, flush=True)
            if not heard:  # the first stop, while the work still runs; a later one cannot hurry its unwinding
                heard.append(signum)
                work_scope.cancel()

        async def watch(*, task_status: TaskStatus[None]) -> None:
            with anyio.open_signal_receiver(signal.SIGINT) as signals:  # SIGINT through the loop's own receiver
                task_status.started()
                async for signum in signals:
                    stop(signum)

        await tg.start(watch)  # the receiver is open before the work starts
        loop = asyncio.get_running_loop()
        held.wake = lambda signum: loop.call_soon_threadsafe(stop, signum)
        try:
            if held.heard:  # noted while the receiver opened
                stop(held.heard[0])
            else:
                with work_scope:
                    finished.append(await work())
        except Exception as exc:
            raised.append(exc)
        finally:
            held.wake = None
            unwound.append(True)
        tg.cancel_scope.cancel()
    if heard:
        raise Stopped(heard[0])
    if raised:
        raise raised[0]
    return finished[0]
