"""The channel between the server's side (HTTP, tokens to text, SSE) and the engine's side (the
executor's loop): typed messages over ZeroMQ sockets. ``messages`` is all both sides share;
``engine_side`` runs next to the executor, ``client`` in the server's event loop."""
