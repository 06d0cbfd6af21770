"""executor-bootstrap: LLM executor creation as an async pipeline of explicit, traced stages."""

__version__ = "0.1.0"
