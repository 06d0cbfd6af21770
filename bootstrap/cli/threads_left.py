"""What a command leaves running when it ends: tqdm's monitor thread stopped, the other threads
joined for a moment, any still alive named in the log (none should be)."""

from __future__ import annotations

import logging
import sys
import threading
import time

THREAD_JOIN_S = 5.0


def report_threads(log: logging.Logger) -> None:
    """Join what is left for a moment, then name any thread still alive (none should be)."""
    _stop_tqdm_monitor()
    deadline = time.monotonic() + THREAD_JOIN_S
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(max(deadline - time.monotonic(), 0))
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        log.warning("bootstrap serve: stopped; threads still alive: %s", ", ".join(alive))
    else:
        log.info("bootstrap serve: stopped; no thread left")


def _stop_tqdm_monitor() -> None:
    """Loading weights shows a tqdm bar, which starts tqdm's monitor thread; tqdm never stops it."""
    monitor_class = getattr(sys.modules.get("tqdm.std"), "TMonitor", None)
    for thread in threading.enumerate():
        if monitor_class is not None and isinstance(thread, monitor_class):
            thread.exit()
