"""The command's first moment and the CPU the process had spent by then, taken before the command's
imports (``bootstrap.cli`` imports this first): its start as the interpreter measures it
(``bootstrap.pipeline.process.spawn_time_ns``)."""

import time

FIRST_MOMENT = (time.time_ns(), time.process_time_ns())
