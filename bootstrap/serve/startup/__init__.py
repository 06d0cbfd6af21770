"""The bootstrap behind the server: its background task, the probes and the per-stage progress they show."""
