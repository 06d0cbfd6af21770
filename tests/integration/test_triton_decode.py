"""The Triton paged decode kernel against a direct float64 computation, in Triton's CPU
interpreter (a subprocess with ``TRITON_INTERPRET=1``); skipped where Triton is not installed
(CPU builds of torch come without it). On CUDA, tests/gpu runs the compiled kernel."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

SCRIPT = textwrap.dedent("""
    import torch
    from bootstrap.engine.kernels.paged_kv import available, paged_decode

    assert available(torch.device("cpu"), 16) and not available(torch.device("cpu"), 8)
    torch.manual_seed(0)
    B, H, KVH, D, TPB, NB = 3, 4, 2, 16, 16, 12
    kc, vc = torch.randn(NB, TPB, KVH, D), torch.randn(NB, TPB, KVH, D)
    tables = torch.tensor([[3, 7, 1, 0, 0], [5, 2, 9, 11, 4], [8, 0, 0, 0, 0]])
    lens = torch.tensor([40, 70, 5])
    q = torch.randn(B, H, D)

    def reference(b, window, softcap, scale=0.3, kc=kc, vc=vc, q=q):
        n = int(lens[b])
        slots = torch.tensor([int(tables[b][p // TPB]) * TPB + p % TPB for p in range(n)])
        k = kc.view(-1, KVH, D)[slots].double().repeat_interleave(H // KVH, 1)
        v = vc.view(-1, KVH, D)[slots].double().repeat_interleave(H // KVH, 1)
        s = torch.einsum("hd,khd->hk", q[b].double(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if window:
            s = s.masked_fill(torch.arange(n) < n - window, float("-inf"))
        return torch.einsum("hk,khd->hd", s.softmax(-1), v)

    # splits: None picks 1 here (a table 5 columns wide); at 3 and 5 some runs hold no block
    for splits in [None, 1, 3, 5]:
        for window, softcap in [(None, None), (20, None), (None, 2.0), (7, 1.5)]:
            got = paged_decode(q, kc, vc, tables, lens, 0.3, window, softcap, splits).double()
            for b in range(B):
                torch.testing.assert_close(got[b], reference(b, window, softcap), atol=1e-5, rtol=1e-5)

    # two and four blocks an iteration (the benchmark's to vary): the same answers; three refused
    for step in [2, 4]:
        for splits in [None, 3]:
            for window, softcap in [(None, None), (7, 1.5)]:
                got = paged_decode(q, kc, vc, tables, lens, 0.3, window, softcap, splits, blocks_per_step=step).double()
                for b in range(B):
                    torch.testing.assert_close(got[b], reference(b, window, softcap), atol=1e-5, rtol=1e-5)
    try:
        paged_decode(q, kc, vc, tables, lens, 0.3, blocks_per_step=3)
        raise AssertionError("blocks_per_step=3 was accepted")
    except ValueError as exc:
        assert "blocks_per_step" in str(exc)

    # q as attention gets it: a view of the fused q/k/v rows (row stride past H * D), read in place
    qkv = torch.randn(B, (H + 2 * KVH) * D)
    view = qkv[:, : H * D].view(B, H, D)
    assert not view.is_contiguous()
    assert torch.equal(paged_decode(view, kc, vc, tables, lens, 0.3, None, None, 3),
                       paged_decode(view.contiguous(), kc, vc, tables, lens, 0.3, None, None, 3))

    from bootstrap.engine.kernels.paged_kv import write_kv

    key = torch.randn(1, KVH, 4, D)[0].transpose(0, 1)  # [T, KVH, D] as attention gets it: strided
    value = torch.randn(1, 4, KVH, D)[0]
    rows, slots = torch.tensor([0, 1, 2, 3, 3]), torch.tensor([5, 17, 33, 60, 60])  # a padding row repeats row 3
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv(key, value, rows, slots, kc2, vc2)
    flat_k, flat_v = kc2.view(-1, KVH, D), vc2.view(-1, KVH, D)
    assert torch.equal(flat_k[slots[:4]], key) and torch.equal(flat_v[slots[:4]], value)
    untouched = torch.ones(NB * TPB, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], kc.view(-1, KVH, D)[untouched])

    # an e4m3 pool: read multiplied by its scales (the writes' rounding is tested on CUDA: the
    # interpreter rounds float32 to e4m3 unlike the GPU)
    from bootstrap.engine.layers.fp8 import to_fp8

    scales = (torch.tensor(0.7), torch.tensor(1.3))
    kc8, vc8 = to_fp8(kc, scales[0]), to_fp8(vc, scales[1])
    kd, vd = kc8.float() * scales[0], vc8.float() * scales[1]
    for splits, step in [(1, 1), (3, 1), (3, 2)]:
        for window, softcap in [(None, None), (7, 1.5)]:
            got = paged_decode(q, kc8, vc8, tables, lens, 0.3, window, softcap, splits, scales, step).double()
            for b in range(B):
                want = reference(b, window, softcap, kc=kd, vc=vd)
                torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)
    # float16 dots over a bfloat16 query (the query scaled first): float16's rounding, not bfloat16's;
    # the default there (a float32 query, above, keeps float32 dots)
    qb = q.to(torch.bfloat16)
    for splits, step in [(1, 1), (3, 2)]:
        got = paged_decode(qb, kc8, vc8, tables, lens, 0.3, 7, 1.5, splits, scales, step, torch.float16).double()
        for b in range(B):
            want = reference(b, 7, 1.5, q=qb.double(), kc=kd, vc=vd)
            torch.testing.assert_close(got[b], want, atol=2e-2, rtol=2e-2)
        bf16_dots = paged_decode(qb, kc8, vc8, tables, lens, 0.3, 7, 1.5, splits, scales, step, torch.bfloat16)
        assert not torch.equal(got, bf16_dots.double())
        default = paged_decode(qb, kc8, vc8, tables, lens, 0.3, 7, 1.5, splits, scales, step)  # float16's, by default
        assert torch.equal(got, default.double())
    try:
        paged_decode(qb, kc8, vc8, tables, lens, 0.3, dot_dtype=torch.float32)
        raise AssertionError("dot_dtype=float32 over a bfloat16 query was accepted")
    except ValueError as exc:
        assert "dot_dtype" in str(exc)
    print("ok")
""")


def test_kernels_match_direct_attention_and_writes():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
