"""Analytic memory of one forward pass and of a started executor, for the simulated backend.

Pure arithmetic on a ``ModelShape``; no torch. The figures are estimates of what torch's
caching allocator would see at its peak, term by term (the formulas: ``activation_peak``), so a
simulated profile can be explained line by line. The layout is what transformers' model code
keeps alive (the native engine runs that code), calibrated against measured forwards
(benchmarks/README.md, "Calibration constants in the code"); the known gap is DeepSeek-V2's MoE,
where transformers keeps more per-expert copies than counted here. Every term is non-decreasing
in ``max_num_tokens``, so the peak is monotonic in it.
"""

from __future__ import annotations

from dataclasses import dataclass

from bootstrap.capacity import dummy_request_lengths
from bootstrap.capacity.shape import ATTENTION, RECURRENT, ModelShape

MiB = 1024**2
CUBLAS_WORKSPACE_BYTES = 32 * MiB
FP32 = 4
INT32 = 4
INT64 = 8

_WEIGHT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_dtype_bytes(dtype: str) -> int:
    """Bytes per weight element for a resolved weight dtype (not "auto")."""
    try:
        return _WEIGHT_DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"weight dtype must be one of {', '.join(_WEIGHT_DTYPE_BYTES)}, got {dtype!r}") from None


def _shard(n: int, tp: int) -> int:
    return -(-n // tp)


@dataclass(frozen=True)
class ActivationEstimate:
    """The peak extra bytes of one forward, and the terms it was built from (for spans/docs)."""

    total: int
    terms: dict[str, int]


def activation_peak(
    shape: ModelShape, *, max_num_tokens: int, max_seq_len: int, dtype_bytes: int, tp: int = 1
) -> ActivationEstimate:
    """The analytic peak of one forward over ``max_num_tokens`` tokens. One forward runs layer
    after layer and frees each layer's intermediates before the next, so the peak is the largest
    phase below on top of the stream that lives through the whole forward. Per tensor-parallel
    rank:

      T = max_num_tokens of the dummy step     b = weight dtype bytes    tp = tensor_parallel_size
      h = hidden_size   nh, nkv = query / KV heads   d = head_dim   I = intermediate_size   V = vocab
      R = number of dummy requests = len(dummy_request_lengths(T, max_seq_len))
      shard(x) = ceil(x / tp): a tensor split across ranks (heads, MLP columns, experts' columns)

      stream       = 3*T*h*b                residual / layer input, RMSNorm output, and the embedding
                                            output that the model's forward keeps referenced
                   + 2*T*r*b + 8*T          rotary cos and sin (r = head_dim, MLA: qk_rope_head_dim;
                                            0 without rotary) and int64 position ids
                   + T*T                    a bool attention mask, with sliding-window layers once
                                            T >= the smallest window (sdpa then cannot use is_causal)
      attention    = T*shard((nh + 2*nkv)*d)*b          q, k, v projections
                   + T*shard((nh + nkv)*d)*b            q and k after rotary
                   + T*shard(nh*d)*b + T*h*b            attention output, o_proj output
                   + T*shard(nh)*4                      fp32 softmax log-sum-exp (flash attention)
         MLA:        T*q_lora*b + T*(kv_lora + rope)*b  compressed q and kv latents (replicated)
                   + T*shard(nh*(nope + rope))*b        q after up-projection
                   + T*shard(nh*(nope + rope + v))*b    k and v decompressed for prefill
                   + T*shard(nh*v)*b + T*h*b + T*shard(nh)*4   attention and o_proj outputs, lse
         Mamba:      T*shard(2*di)*b + 2*T*shard(di)*b  in_proj (x, z), conv and scan outputs
                   + T*(dt_rank + 2*d_state)*b + T*h*b  x_proj (B, C, dt), out_proj output
      dense MLP    = 3*T*shard(I)*b + T*h*b             gate, up, act(gate)*up; down_proj output
      MoE MLP      = T*E*4                              fp32 router logits (replicated)
                   + T*k*h*b                            routed copies of the tokens (k = experts_per_token)
                   + 4*T*k*shard(I_moe)*b               fused gate_up (2 I), act, act*up per routed copy
                   + T*h*b                              the combined expert output
                   + 3*T*shard(I_shared)*b              shared experts, where the model has them
      logits       = R*V*4                              fp32 logits of each request's last token only
      workspace    = 32 MiB                             cuBLAS workspace (torch's Hopper default,
                                                        ``:4096:8`` = 8 x 4 MiB, taken from the allocator)
      peak         = stream + max(attention, MLP, logits) + workspace
    """
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens must be >= 1, got {max_num_tokens}")
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    t, b, h = max_num_tokens, dtype_bytes, shape.hidden_size
    requests = len(dummy_request_lengths(max_num_tokens, max_seq_len))
    terms = {
        "stream": 3 * t * h * b + 2 * t * _rope_dim(shape) * b + t * INT64 + _mask_bytes(shape, t),
        "mixer": max(_mixer_phases(shape, t, b, tp)),
        "mlp": max(_mlp_phases(shape, t, b, tp)),
        "logits": requests * shape.vocab_size * FP32,
        "workspace": CUBLAS_WORKSPACE_BYTES,
    }
    peak = terms["stream"] + max(terms["mixer"], terms["mlp"], terms["logits"]) + terms["workspace"]
    return ActivationEstimate(peak, terms)


def _mask_bytes(shape: ModelShape, t: int) -> int:
    windows = [w for w in shape.attention_windows if w is not None]
    return t * t if windows and t >= min(windows) else 0


def _rope_dim(shape: ModelShape) -> int:
    if ATTENTION not in shape.layer_kinds or shape.model_type == "jamba":  # Jamba has no positional encoding
        return 0
    return shape.qk_rope_head_dim if shape.kv_lora_rank is not None else shape.head_dim


def _mixer_phases(shape: ModelShape, t: int, b: int, tp: int) -> list[int]:
    phases = [0]
    if ATTENTION in shape.layer_kinds:
        phases.append(_mla(shape, t, b, tp) if shape.kv_lora_rank is not None else _attention(shape, t, b, tp))
    if RECURRENT in shape.layer_kinds:
        phases.append(_mamba(shape, t, b, tp))
    return phases


def _attention(shape: ModelShape, t: int, b: int, tp: int) -> int:
    nh, nkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    qkv = t * _shard((nh + 2 * nkv) * d, tp) * b + t * _shard((nh + nkv) * d, tp) * b
    return qkv + t * _shard(nh * d, tp) * b + t * shape.hidden_size * b + t * _shard(nh, tp) * FP32


def _mla(shape: ModelShape, t: int, b: int, tp: int) -> int:
    nh, rope, nope, v = shape.num_heads, shape.qk_rope_head_dim, shape.qk_nope_head_dim, shape.v_head_dim
    latents = t * ((shape.q_lora_rank or 0) + shape.kv_lora_rank + rope) * b
    q = t * _shard(nh * (nope + rope), tp) * b
    kv = t * _shard(nh * (nope + rope + v), tp) * b
    out = t * _shard(nh * v, tp) * b + t * shape.hidden_size * b
    return latents + q + kv + out + t * _shard(nh, tp) * FP32


def _mamba(shape: ModelShape, t: int, b: int, tp: int) -> int:
    di = shape.mamba_d_inner
    projections = t * _shard(2 * di, tp) * b + 2 * t * _shard(di, tp) * b
    return projections + t * (shape.mamba_dt_rank + 2 * shape.mamba_d_state + shape.hidden_size) * b


def _mlp_phases(shape: ModelShape, t: int, b: int, tp: int) -> list[int]:
    phases = [0]
    if not all(shape.moe_layers):
        phases.append(3 * t * _shard(shape.intermediate_size, tp) * b + t * shape.hidden_size * b)
    if any(shape.moe_layers):
        k, h = shape.experts_per_token, shape.hidden_size
        routed = t * k * h * b + 4 * t * k * _shard(shape.moe_intermediate_size, tp) * b + t * h * b
        shared = 3 * t * _shard(shape.shared_expert_intermediate_size, tp) * b
        phases.append(t * shape.num_experts * FP32 + routed + shared)
    return phases


def sampler_state_bytes(max_batch_size: int, vocab_size: int) -> int:
    """Sampler buffers: per batch slot and vocab entry, fp32 logits, fp32 sorted probabilities
    and int64 sort indices (top-k / top-p): ``max_batch_size * V * (4 + 4 + 8)``."""
    return max_batch_size * vocab_size * (FP32 + FP32 + INT64)


def block_table_bytes(max_batch_size: int, max_seq_len: int, tokens_per_block: int, pools: int) -> int:
    """int32 block tables of every pool: ``pools * max_batch_size * ceil(max_seq_len / tpb) * 4``."""
    return pools * max_batch_size * -(-max_seq_len // tokens_per_block) * INT32
