"""The paged KV cache: the pool and its block tables (``pool``), what sizes and reports it (``sizing``)."""

from bootstrap.engine.kv_cache.pool import PagedKVCache
from bootstrap.engine.kv_cache.sizing import KVCacheFull, KVCacheSpec, KVCacheStats, zeros

__all__ = ["KVCacheFull", "KVCacheSpec", "KVCacheStats", "PagedKVCache", "zeros"]
