"""One request as the engine holds it: its sequence, prompt rules, timing and draft acceptance."""
