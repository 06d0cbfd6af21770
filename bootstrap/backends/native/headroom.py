"""The native engine's default memory rule on CUDA (the rules: ``bootstrap.capacity.rules``): the
KV cache gets everything after the measured peak except what its executor can still need on top
of that peak, bounded by ``headroom_terms``.

Profiling measures one step of ``max_num_tokens`` fresh prompt tokens; with the Triton paged
decode kernel, decode rows copy nothing of the running requests' contexts and fresh prompts
attend their own keys (``engine.layers.attention``), so what a served step adds is bounded.
Where the kernel cannot run (no Triton, or blocks under 16 tokens), decode rows gather a layer
of every running request's context, which no fixed headroom bounds well: there is no default,
and TensorRT-LLM's rule applies (``free_gpu_memory_fraction`` 0.9).
"""

from __future__ import annotations

from bootstrap.backends.artifacts import ResolvedClasses
from bootstrap.capacity import MemoryProfile, kv_dtype_bytes
from bootstrap.config import BootstrapConfig

WORKSPACE_BYTES = 512 * 1024**2


def headroom_terms(profile: MemoryProfile | None, resolved: ResolvedClasses, config: BootstrapConfig) -> dict[str, int]:
    """The headroom's terms in bytes, and their ``total``:

    - ``activation``: the measured activation peak once more: allocator fragmentation between
      steps of different shapes, and a step's working set at deep contexts (before profiling,
      ``profile`` None: the probe cap, not measured yet, it counts 0);
    - ``continued_chunk``: the one continued prompt chunk a step can hold (the scheduler splits at
      most one prompt per step) gathers its cached keys and values of one layer, up to
      ``max_seq_len`` tokens, and masks ``max_num_tokens`` queries against them (a bool mask and
      SDPA's additive bias in the compute dtype); in a model with sliding windows (the families
      with soft-caps have them too) the masked call also repeats them per grouped query head;
    - ``workspace``: ``WORKSPACE_BYTES`` for library workspaces created after profiling (cuBLAS on
      new streams, Triton's and the compiled norms' kernels)."""
    layer_bytes_per_token = resolved.cost.slope // max(resolved.shape.num_layers, 1)  # keys and values, one rank
    chunk = profile.max_num_tokens if profile is not None else config.max_num_tokens
    context, shape, compute_bytes = resolved.max_seq_len, resolved.shape, kv_dtype_bytes(resolved.dtype)
    masked = shape.num_heads > shape.num_kv_heads and any(w is not None for w in shape.layer_windows)
    repeated = 2 * shape.num_heads * shape.head_dim * compute_bytes if masked else 0
    terms = {
        "activation": profile.activation_bytes if profile is not None else 0,
        "continued_chunk": context * (layer_bytes_per_token + repeated)
        + int(chunk * context * (1 + 2 * compute_bytes)),
        "workspace": WORKSPACE_BYTES,
    }
    return {**terms, "total": sum(terms.values())}
