"""Paged KV cache: one block pool for all layers of a model, and per-request block tables.

The pool is one tensor ``[2, layers, blocks, tokens_per_block, kv_heads, head_dim]`` (keys, then
values); a request's token ``p`` lives in slot ``table[p // tpb] * tpb + p % tpb`` of a layer's
flattened view. One class serves the probe, target and draft pools. Freed blocks are reused last
in, first out; on the CPU the pool's pages are mapped zeroed on first touch. ``fork`` gives a
child the parent's full blocks, counted, and a copy of its partial last one; a full block is never
written again, so a shared one stays shared until every holder frees it. Prefix caching
(``match``, ``publish``, ``allocate(prefix=)``; design.md): a registered block nobody holds stays
cached and counts as free, handed out only when no plain free block is left, least recently
released first. ``stats()``: the pool, the blocks handed out, the tokens held (a shared block
counts once), the registered blocks and those of them nobody holds. An e4m3 pool (``kv_cache_dtype
fp8``) stores keys and values divided by its per-layer ``scales`` (1.0, or the checkpoint's:
``take_scales``); the attention multiplies them back.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bootstrap.config import is_int
from bootstrap.engine.kv_cache.sizing import (
    KVCacheFull,
    KVCacheSpec,
    KVCacheStats,
    bytes_per_token,
    check_positive,
    zeros,
)


class PagedKVCache:
    """A block pool with per-request block tables; see the module docstring for the layout."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, tokens_per_block: int, device: torch.device | str) -> None:
        check_positive("num_blocks", num_blocks)
        check_positive("tokens_per_block", tokens_per_block)
        self.spec = spec
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.device = torch.device(device)
        shape = (2, spec.num_layers, num_blocks, tokens_per_block, spec.num_kv_heads, spec.head_dim)
        # Zeros, not empty: masked attention weights are exactly 0, and 0 * NaN garbage would be NaN.
        self._kv: torch.Tensor | None = zeros(shape, spec.dtype, self.device)
        self.scales = torch.ones(2, spec.num_layers, dtype=torch.float32, device=self.device)  # K, V per layer
        self._free: deque[int] = deque(range(num_blocks))  # neither held nor cached
        self._tables: dict[Any, list[int]] = {}
        self._lengths: dict[Any, int] = {}
        self._refs: dict[int, int] = {}  # block -> requests holding it (every held block)
        self._cached: dict[bytes, int] = {}  # digest -> block (prefix caching)
        self._digest: dict[int, bytes] = {}  # block -> digest
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by none: least recently released first
        self._lock = threading.Lock()  # stats() may be read from another thread than the engine's
        self.on_copy: Callable[[Sequence[int], Sequence[int]], None] | None = None  # see copy_blocks

    # ---- sizing -------------------------------------------------------------------------------

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Keys and values of one token over all layers: ``2 * layers * kv_heads * head_dim * itemsize``."""
        return bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)

    @classmethod
    def from_tokens(
        cls, spec: KVCacheSpec, max_tokens: int, tokens_per_block: int, device: torch.device | str
    ) -> PagedKVCache:
        """A pool holding at least ``max_tokens`` tokens (rounded up to whole blocks)."""
        check_positive("max_tokens", max_tokens)
        check_positive("tokens_per_block", tokens_per_block)
        return cls(spec, -(-max_tokens // tokens_per_block), tokens_per_block, device)

    @classmethod
    def from_bytes(
        cls, spec: KVCacheSpec, budget_bytes: int, tokens_per_block: int, device: torch.device | str
    ) -> PagedKVCache:
        """The largest pool of whole blocks that fits in ``budget_bytes``."""
        check_positive("budget_bytes", budget_bytes)
        check_positive("tokens_per_block", tokens_per_block)
        block_bytes = spec.bytes_per_token * tokens_per_block
        if budget_bytes < block_bytes:
            raise ValueError(
                f"budget_bytes ({budget_bytes}) is below one block ({block_bytes} bytes = "
                f"{tokens_per_block} tokens x {spec.bytes_per_token} bytes/token)"
            )
        return cls(spec, budget_bytes // block_bytes, tokens_per_block, device)

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_token * self.tokens_per_block

    # ---- tensors ------------------------------------------------------------------------------

    def k_cache(self, layer: int) -> torch.Tensor:
        """Keys of ``layer``: ``[blocks, tokens_per_block, kv_heads, head_dim]``."""
        return self._pool()[0, layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Values of ``layer``: ``[blocks, tokens_per_block, kv_heads, head_dim]``."""
        return self._pool()[1, layer]

    def k_scale(self, layer: int) -> torch.Tensor:
        """The keys' dequantization scale of ``layer`` (0-dim float32; 1.0 unless ``take_scales``)."""
        return self.scales[0, layer]

    def v_scale(self, layer: int) -> torch.Tensor:
        return self.scales[1, layer]

    @property
    def quantized(self) -> bool:
        """True for an e4m3 pool: writes divide by the scales, reads multiply."""
        return self.spec.dtype == torch.float8_e4m3fn

    def take_scales(self, keys: Sequence[float] | None, values: Sequence[float] | None) -> None:
        """A checkpoint's per-layer scales, or 1.0 where it has none (in place: a captured graph
        reads the same tensor)."""
        if keys is None or values is None:
            self.scales.fill_(1.0)
            return
        if len(keys) != self.spec.num_layers or len(values) != self.spec.num_layers:
            raise ValueError(f"KV scales: {len(keys)} and {len(values)} given for {self.spec.num_layers} layers")
        if not all(math.isfinite(s) and s > 0 for s in (*keys, *values)):
            raise ValueError("KV scales must be finite and positive")
        self.scales.copy_(torch.tensor([list(keys), list(values)], dtype=torch.float32))

    def _pool(self) -> torch.Tensor:
        if self._kv is None:
            raise RuntimeError("this KV cache was released")
        return self._kv

    def release(self) -> None:
        """Free the pool tensor and forget every request; safe to call twice."""
        with self._lock:
            self._kv = None
            self._tables.clear()
            self._lengths.clear()
            self._refs.clear()
            self._free.clear()
            self._forget_digests()

    @property
    def released(self) -> bool:
        return self._kv is None

    # ---- block tables -------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens occupies."""
        return -(-num_tokens // self.tokens_per_block)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: the plain free ones and the cached ones."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, num_tokens: int) -> bool:
        """True if a new request of ``num_tokens`` tokens fits in the free blocks now."""
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def allocate(self, request_id: Any, num_tokens: int, prefix: Sequence[int] = ()) -> list[int]:
        """Start a block table for ``request_id`` holding ``num_tokens`` tokens (may be 0); with
        ``prefix`` (cached blocks, as ``match`` found them) its first blocks are those, shared."""
        self._pool()
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds KV blocks; extend or free it")
        if not isinstance(num_tokens, int) or num_tokens < len(prefix) * self.tokens_per_block:
            raise ValueError(
                f"num_tokens must be an integer >= {len(prefix) * self.tokens_per_block} (the prefix's "
                f"{len(prefix)} full blocks), got {num_tokens!r}"
            )
        with self._lock:
            unknown = [b for b in prefix if b not in self._digest]
            if unknown:
                raise ValueError(f"prefix block {unknown[0]} is not cached (match the digests again)")
            fresh = self.blocks_needed(num_tokens) - len(prefix)
            self._take(fresh + sum(b in self._evictable for b in prefix), request_id)
            for block in prefix:
                self._hold(block)
            self._tables[request_id] = [*prefix, *(self._fresh_block() for _ in range(fresh))]
            self._lengths[request_id] = num_tokens
        return self._tables[request_id]

    def extend(self, request_id: Any, num_tokens: int) -> list[int]:
        """Append ``num_tokens`` tokens to a request, adding blocks as its last one fills."""
        length = self.num_tokens(request_id)
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        table = self._tables[request_id]
        extra = self.blocks_needed(length + num_tokens) - len(table)
        with self._lock:
            self._take(extra, request_id)
            table.extend(self._fresh_block() for _ in range(extra))
            self._lengths[request_id] = length + num_tokens
        return table

    def truncate(self, request_id: Any, num_tokens: int) -> list[int]:
        """Keep only a request's first ``num_tokens`` tokens (a speculative step's rejected
        tokens rolled back): the blocks past them go back to the pool. Refused when the cut
        would leave the request writing into a block another request shares."""
        length = self.num_tokens(request_id)
        if not is_int(num_tokens) or not 0 <= num_tokens <= length:
            raise ValueError(
                f"num_tokens must be an integer in [0, {length}] (what request {request_id!r} holds), "
                f"got {num_tokens!r}"
            )
        table, keep = self._tables[request_id], self.blocks_needed(num_tokens)
        with self._lock:
            if num_tokens % self.tokens_per_block and self._refs.get(table[keep - 1], 1) > 1:
                raise ValueError(
                    f"request {request_id!r}: cannot cut to {num_tokens} tokens inside block "
                    f"{table[keep - 1]}, which another request shares"
                )
            dropped, table[keep:] = table[keep:], []
            self._lengths[request_id] = num_tokens
            if self._kv is not None:
                self._let_go(dropped)
        return table

    def _take(self, count: int, request_id: Any) -> None:
        if count > self.num_free_blocks:
            raise KVCacheFull(
                f"request {request_id!r} needs {count} more KV blocks but only {self.num_free_blocks} of "
                f"{self.num_blocks} are free ({self.tokens_per_block} tokens per block)"
            )

    def _fresh_block(self) -> int:
        """A block for new tokens, held once: a plain free one (the last released first), else
        the cached block released longest ago, which forgets its digest (call under the lock)."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._digest.pop(block)]
        self._refs[block] = 1
        return block

    def _hold(self, block: int) -> None:
        """One holder more for ``block`` (call under the lock)."""
        self._evictable.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def fork(self, parent_id: Any, child_id: Any) -> list[int]:
        """Give ``child_id`` the tokens ``parent_id`` holds: its full blocks shared, its partial
        last block (if any) copied into a block of the child's own."""
        self._pool()
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already holds KV blocks; extend or free it")
        length = self.num_tokens(parent_id)
        full, table = length // self.tokens_per_block, self._tables[parent_id]
        with self._lock:
            self._take(len(table) - full, child_id)
            copies = [self._fresh_block() for _ in table[full:]]
            for block in table[:full]:
                self._hold(block)
            self._tables[child_id] = table[:full] + copies
            self._lengths[child_id] = length
        self.copy_blocks(table[full:], copies)
        return self._tables[child_id]

    def copy_blocks(self, sources: Sequence[int], copies: Sequence[int]) -> None:
        """Copy each block of ``sources`` whole into the block of ``copies`` at its index (after
        ``on_copy``, which a runner sets to send the copy to other ranks' pools)."""
        if self.on_copy is not None:
            self.on_copy(sources, copies)
        pool = self._pool()
        for source, copy in zip(sources, copies):
            pool[:, :, copy].copy_(pool[:, :, source])

    def free(self, request_id: Any) -> None:
        """Return a request's blocks to the pool, each once no other request holds it; unknown
        ids are ignored (idempotent)."""
        with self._lock:
            table = self._tables.pop(request_id, None)
            self._lengths.pop(request_id, None)
            if table and self._kv is not None:
                self._let_go(table)

    def _let_go(self, blocks: list[int]) -> None:
        """One holder fewer for each of ``blocks``; one nobody holds now is cached if it has a
        digest (the most recently released last), else free, the table's first block reused
        first (call under the lock)."""
        released = []
        for block in blocks:
            holders = self._refs.pop(block)
            if holders > 1:
                self._refs[block] = holders - 1
            elif block in self._digest:
                self._evictable[block] = None
            else:
                released.append(block)
        self._free.extendleft(reversed(released))  # LIFO: reuse the last touched

    def shared_blocks(self) -> int:
        """Blocks more than one request holds."""
        with self._lock:
            return sum(holders > 1 for holders in self._refs.values())

    # ---- prefix caching ------------------------------------------------------------------------

    def match(self, digests: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of leading ``digests`` (``prefix_hash``)."""
        blocks = []
        with self._lock:
            for digest in digests:
                block = self._cached.get(digest)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def publish(self, request_id: Any, digests: Sequence[bytes]) -> int:
        """Register the first ``len(digests)`` blocks of ``request_id`` (full, and never written
        again) under their digests, each unless it or its digest is registered already; returns
        how many it registered."""
        table = self.block_table(request_id)
        if len(digests) > len(table) or len(digests) * self.tokens_per_block > self.num_tokens(request_id):
            raise ValueError(
                f"request {request_id!r} holds {self.num_tokens(request_id)} tokens: fewer than "
                f"{len(digests)} full blocks of {self.tokens_per_block}"
            )
        added = 0
        with self._lock:
            for block, digest in zip(table, digests):
                if block not in self._digest and digest not in self._cached:
                    self._cached[digest], self._digest[block] = block, digest
                    added += 1
        return added

    def clear_cache(self) -> None:
        """Forget every digest: cached blocks nobody holds become plain free blocks."""
        with self._lock:
            self._free.extend(self._evictable)
            self._forget_digests()

    def _forget_digests(self) -> None:
        self._evictable.clear()
        self._cached.clear()
        self._digest.clear()

    def holds(self, request_id: Any) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: Any) -> list[int]:
        self.num_tokens(request_id)
        return self._tables[request_id]

    def num_tokens(self, request_id: Any) -> int:
        """Tokens ``request_id`` holds."""
        if request_id not in self._lengths:
            raise KeyError(f"request {request_id!r} holds no KV blocks")
        return self._lengths[request_id]

    def slots(self, request_id: Any, start: int, end: int) -> torch.Tensor:
        """Flat slot ids (long, on the CPU) of token positions ``[start, end)`` of a request."""
        if not 0 <= start <= end <= self.num_tokens(request_id):
            raise ValueError(
                f"positions [{start}, {end}) out of range for request {request_id!r} "
                f"holding {self.num_tokens(request_id)} tokens"
            )
        positions = torch.arange(start, end)
        table = torch.tensor(self._tables[request_id], dtype=torch.long)
        return table[positions // self.tokens_per_block] * self.tokens_per_block + positions % self.tokens_per_block

    # ---- accounting ---------------------------------------------------------------------------

    def stats(self) -> KVCacheStats:
        """A consistent snapshot; safe to call from any thread."""
        with self._lock:
            used_blocks = len(self._refs)
            extra_holds = sum(self._refs.values()) - used_blocks  # a shared block's other holders
            used_tokens = sum(self._lengths.values()) - extra_holds * self.tokens_per_block  # shared: full blocks
            free_blocks = self.num_free_blocks
            cached, cached_free = len(self._digest), len(self._evictable)
            total_blocks = 0 if self._kv is None else self.num_blocks
        return KVCacheStats(
            total_bytes=total_blocks * self.bytes_per_block,
            used_bytes=used_tokens * self.spec.bytes_per_token,
            allocated_bytes=used_blocks * self.bytes_per_block,
            total_blocks=total_blocks,
            used_blocks=used_blocks,
            free_blocks=free_blocks,
            tokens_per_block=self.tokens_per_block,
            used_tokens=used_tokens,
            cached_blocks=cached,
            cached_free_blocks=cached_free,
        )
