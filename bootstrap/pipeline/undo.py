"""``Undo``: the release actions of one stage attempt, run last-in first-out.

A stage (or the backend it calls) pushes the action that releases each thing it allocates,
right after allocating it. If the attempt fails, the pipeline runs them (rollback); if it
succeeds, they stay with the artifact and run when the artifact is consumed or the run is
cancelled. An action that raises does not stop the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

log = logging.getLogger(__name__)


class Undo:
    def __init__(self) -> None:
        self._actions: list[Callable[[], Any]] = []

    def push(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._actions.append(partial(fn, *args, **kwargs) if args or kwargs else fn)

    def run(self) -> list[BaseException]:
        """Run every action, newest first; return the errors they raised (logged, not raised)."""
        errors: list[BaseException] = []
        while True:
            try:
                action = self._actions.pop()  # atomic: no check-then-pop race with another run()
            except IndexError:
                break
            try:
                action()
            except Exception as exc:  # one failed release must not leak the rest
                log.warning("release action %r failed: %s", action, exc)
                errors.append(exc)
        return errors

    def __len__(self) -> int:
        return len(self._actions)
