"""Sampling: per-request parameters, the batched sampler, logits processing and a two-stage argmax."""
