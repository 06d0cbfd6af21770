"""The identity of a full KV block for prefix caching: a digest chained from the previous block's
digest and this block's token ids, seeded by the request's ``cache_salt``.

Two requests share a cached block only when every token before it and in it is the same, and
their salts are equal (no salt is its own value). BLAKE2b, not Python's ``hash``: a tenant must
not be able to craft a prompt whose blocks collide with another's (vLLM's CVE-2025-25183 was a
predictable ``hash(None)``), and 128 bits make an accidental collision negligible.
"""

from __future__ import annotations

import hashlib
from array import array

DIGEST_BYTES = 16


def _seed(salt: str | None) -> bytes:
    marker = b"\x00" if salt is None else b"\x01" + salt.encode("utf-8")  # no salt differs from every salt
    return hashlib.blake2b(b"bootstrap-prefix-v1" + marker, digest_size=DIGEST_BYTES).digest()


def extend_hashes(hashes: list[bytes], token_ids: list[int], tokens_per_block: int, salt: str | None) -> list[bytes]:
    """Append to ``hashes`` (the digests of the first ``len(hashes)`` full blocks of
    ``token_ids``) the digests of the full blocks after them; returns ``hashes``."""
    previous = hashes[-1] if hashes else _seed(salt)
    for start in range(len(hashes) * tokens_per_block, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        block = array("q", token_ids[start : start + tokens_per_block]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=DIGEST_BYTES).digest()
        hashes.append(previous)
    return hashes
