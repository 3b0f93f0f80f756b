"""What one SOE scan call on the Triton backend allocates, counted from the tensors it creates, without a
GPU: the autograd Function runs on meta tensors with its launches captured instead of run
(kernels._common.capture_launches), under a dispatch mode that records every tensor an op creates (an
output that aliases no input). benchmarks/scan_memory.py prints it; pretrain.plan counts it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels._common import capture_launches

CAPABILITY = 90  # the launches of an H100


class _Created(TorchDispatchMode):
    """Records the bytes of every tensor an op creates (outputs that alias no input: views do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        outs = out if isinstance(out, tuple | list) else (out,)
        for ret, t in zip(returns, outs):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                self.sizes.append(t.numel() * t.element_size())
        return out


def scan_allocations(
    sizes: tuple[int, int, int, int, int], seq_len: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16
) -> dict[str, float]:
    """Bytes created by one Triton SOE scan call, forward and backward, at ``sizes`` = (heads, terms,
    features, value width, chunk): "forward", "backward" (totals) and "largest" (one buffer)."""
    from kernels.soe.gpu.function import SoeScanTriton

    heads, n_terms, feat, width, chunk = sizes
    meta = {"device": "meta", "dtype": dtype}
    q, k = (torch.zeros(batch, seq_len, heads, feat, **meta, requires_grad=True) for _ in range(2))
    v = torch.zeros(batch, seq_len, heads, width, **meta, requires_grad=True)
    coef = torch.zeros(batch, seq_len, heads, n_terms, **meta, requires_grad=True)
    log_lam = torch.zeros(heads, n_terms, device="meta")  # VORT's decays: buffers, no gradient
    g0 = torch.zeros(batch, heads, n_terms, feat, width, device="meta")
    b0 = torch.zeros(batch, heads, n_terms, feat, device="meta")
    d_out = torch.zeros(batch, seq_len, heads, width, **meta)
    d_z = torch.zeros(batch, seq_len, heads, **meta)
    with capture_launches(CAPABILITY):
        forward, backward = _Created(), _Created()
        with forward:
            o, z, _g, _b = SoeScanTriton.apply(q, k, v, coef, log_lam, g0, b0, chunk, None)
        with backward:
            torch.autograd.backward((o, z), (d_out, d_z))
    return {"forward": sum(forward.sizes), "backward": sum(backward.sizes),
            "largest": max(forward.sizes + backward.sizes)}  # fmt: skip
