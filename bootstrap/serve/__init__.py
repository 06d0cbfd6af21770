"""``bootstrap serve``: an OpenAI-compatible HTTP server that awaits the bootstrap pipeline.

app.py (factory and lifespan), state.py (phase, in-flight requests), build_task.py (the
bootstrap task and retry), bootstrap_routes.py (probes, state, events, retry, metrics),
openai_routes.py (models, completions, chat), openai_prompts.py (OpenAI shapes onto the engine's
prompt rules), render.py, jobs.py (one request in the executor), schemas.py, errors.py, auth.py,
metrics.py. The command, its flags and its signals: ``bootstrap.cli.serve``.

Nothing here imports torch, FastAPI or uvicorn at package import, and the serve extra is optional.
"""
