"""Triton kernels (paged decode attention, the one-row product, the fused small steps) and Triton's start."""
