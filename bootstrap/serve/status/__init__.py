"""The status page at ``GET /`` and the recently answered requests it lists."""
