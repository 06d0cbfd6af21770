"""``python -m bootstrap.cli``: the ``bootstrap`` command (``torchrun ... -m bootstrap.cli run``)."""

import sys

from bootstrap.cli.main import main

sys.exit(main())
