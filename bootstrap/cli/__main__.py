"""``python -m bootstrap.cli``: the ``bootstrap`` command (``torchrun ... -m bootstrap.cli run``)."""

from bootstrap.cli.entry import entry

entry()
