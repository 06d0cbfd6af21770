"""Speculative decoding: the speculator (its full account), the acceptance rules, ``auto``'s depth, rows, figures."""
