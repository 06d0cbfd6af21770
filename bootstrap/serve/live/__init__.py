"""A live server's operations over HTTP (``docs/serving.md#live-operations``)."""
