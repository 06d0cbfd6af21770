"""The ``bootstrap`` command: one module per subcommand (``plan``, ``run``, ``tp`` for
``run --tp N``, ``serve``, ``trace``, ``cache``), the flags they share (``args``) and the exit
status table (``exits``); ``main`` parses and dispatches."""

from bootstrap.cli.first_moment import FIRST_MOMENT  # first: the clock before the imports below
from bootstrap.cli.main import main

__all__ = ["FIRST_MOMENT", "main"]
