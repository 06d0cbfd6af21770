"""``python -m bootstrap.cli``: the ``bootstrap`` command (``torchrun ... -m bootstrap.cli run``)."""

from bootstrap.cli.main import entry

entry()
