"""``bootstrap trace``: trace files read back, drawn as timelines in the terminal and as a PNG, and their requests."""
