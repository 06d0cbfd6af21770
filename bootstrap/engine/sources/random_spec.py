"""What ``random:`` names (``random_init``), torch-free: the server checks a swap's model by it
without importing the engine, which runs in another process."""

from __future__ import annotations

from bootstrap.capacity.presets import MODEL_PRESETS

PREFIX = "random:"


def preset_names() -> list[str]:
    """Names accepted after ``random:`` besides a config.json path."""
    return sorted(MODEL_PRESETS)
