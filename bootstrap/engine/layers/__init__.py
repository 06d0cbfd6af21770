"""The building blocks of the engine's own model code (``bootstrap.engine.models``): norms,
rotary embeddings, and linear layers that hold several checkpoint weights fused in one matrix
and say how each is loaded."""
