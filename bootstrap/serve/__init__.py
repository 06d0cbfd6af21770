"""``bootstrap serve``: an OpenAI-compatible HTTP server that awaits the bootstrap pipeline.

app.py (factory and lifespan), state.py (phase, in-flight requests), runner.py (the bootstrap
task and retry), bootstrap_routes.py (probes, state, events, retry, metrics), openai_routes.py
(models, completions, chat), prompts.py, render.py, jobs.py (one request in the executor),
schemas.py, errors.py, auth.py, metrics.py, command.py (the CLI and signals).

Nothing here imports torch, FastAPI or uvicorn at package import: ``bootstrap.cli`` imports
``command`` for its arguments, and the serve extra is optional.
"""
