"""``bootstrap serve``: an OpenAI-compatible HTTP server that awaits the bootstrap pipeline.

``app`` (factory and lifespan), ``state`` (phase, in-flight requests), ``startup/`` (the bootstrap
task, the probes and its progress), ``openai/`` (the OpenAI routes), ``status/`` (the page at
``/``), ``auth``, ``body_limit``, ``errors``, ``metrics``, ``request_trace``. The command, its
flags and its signals: ``bootstrap.cli.serve``.

Nothing here imports torch, FastAPI or uvicorn at package import, and the serve extra is optional.
"""
