"""``python -m bootstrap``: the ``bootstrap`` command, as ``torchrun ... -m bootstrap run`` starts it."""

from bootstrap.cli.entry import entry

entry()
