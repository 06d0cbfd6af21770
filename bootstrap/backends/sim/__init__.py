"""The simulated backend: the stages on a ``FakeDevice`` (``bootstrap plan``, stage tests) and its GPU presets."""
