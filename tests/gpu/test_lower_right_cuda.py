"""The continued chunk's lower-right causal attention on CUDA, through each kernel it picks (flash in
half precision, the efficient kernel's lower-right mask type in float32 without grouped heads, a
boolean mask otherwise), against a float64 softmax of the same scores."""

from __future__ import annotations

import pytest
import torch

from bootstrap.engine.layers.gathered import causal_from_lower_right

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def reference(q, k, v, scale):
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    count, context = q.shape[-2], k.shape[-2]
    allowed = torch.ones(count, context, dtype=torch.bool, device=q.device).tril(context - count)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv_heads", [8, 2])
@pytest.mark.parametrize("head", [64, 72])  # 72: flash pads the head to a multiple of 8 (and back)
@pytest.mark.parametrize(("count", "context"), [(5, 37), (128, 1000), (16, 16)])
def test_lower_right_matches_a_masked_softmax(dtype, kv_heads, head, count, context):
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 8, count, head, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(1, kv_heads, context, head, device="cuda", generator=gen).to(dtype) for _ in range(2))
    scale = 0.11
    out = causal_from_lower_right(q, k, v, scale)
    assert out.shape == q.shape and out.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference(q, k, v, scale), atol=tolerance, rtol=tolerance)
