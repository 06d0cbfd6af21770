"""The ``bootstrap`` command: one module per subcommand (``plan``, ``run``, ``tp`` for
``run --tp N``, ``serve``, ``trace``, ``cache``), the flags they share (``args``) and the exit
status table (``exits``); ``main`` parses and dispatches, ``entry`` is the console script.

Nothing is imported here but the clock (``first_moment``): the console script reads its command
line before the command's imports (``entry``)."""

from bootstrap.cli.first_moment import FIRST_MOMENT

__all__ = ["FIRST_MOMENT"]
