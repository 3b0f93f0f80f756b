"""model.blocks.attention: half-precision attention on a CPU runs on every instruction set."""

import pytest
import torch
import torch.nn.functional as F

from model.blocks import attention


@pytest.mark.parametrize("masked", [False, True])
def test_cpu_bf16_attention_runs_and_matches_fp32(masked):
    """torch's CPU bf16 kernel raises without AVX-512 (`make test-matrix` runs this under avx2 and
    default); the helper must give the fp32 attention rounded to bf16, gradients included."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 16, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    mask = torch.rand(2, 1, 40, 40, generator=gen) > 0.3 if masked else None
    mask = None if mask is None else mask | torch.eye(40, dtype=torch.bool)  # every query sees a key
    kwargs = {"attn_mask": mask} if masked else {"is_causal": True}
    y = attention(q, k, v, **kwargs)
    assert y.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
    torch.testing.assert_close(y.float(), expected, atol=1e-2, rtol=1e-2)
    y.float().pow(2).sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 and t.grad.abs().sum() > 0 for t in (q, k, v))
