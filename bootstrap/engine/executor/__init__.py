"""``PyExecutor``: the request API, its loop and worker thread, request handles and waits, and ``create_executor``."""
