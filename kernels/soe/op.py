"""The SOE scan as the custom op ``recurrent::soe_scan`` (kernels/library.py), which torch.compile keeps
in its graph: the chunked CPU scan or the Triton kernels by backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kernels._common import work_dtype
from kernels.library import scan_op
from kernels.soe.chunk import SoeScanChunked


def _function(backend: str) -> Any:
    if backend == "triton":
        from kernels.soe.triton import SoeScanTriton

        return SoeScanTriton
    return SoeScanChunked


def _fake(q, k, v, coef, log_lam, g0, b0, chunk_size, reset, fast_terms, backend) -> tuple[Tensor, ...]:
    """(o, z, final G, final b) and what the Triton backward reads, the span states and the per-chunk
    states the forward keeps (none, empty, on the CPU)."""
    batch, seq_len, heads, _ = q.shape
    state = torch.float32 if backend == "triton" else work_dtype(q.dtype)
    if backend == "triton":
        from kernels.soe.gpu.function import kept_reads_shape, span_states_shape

        kept = (q.new_empty(span_states_shape(q, v, log_lam, chunk_size), dtype=torch.float32),
                q.new_empty(kept_reads_shape(q, v, log_lam, chunk_size)))  # fmt: skip
    else:
        kept = (q.new_empty(0), q.new_empty(0))
    return (q.new_empty(batch, seq_len, heads, v.shape[-1]), q.new_empty(batch, seq_len, heads),
            g0.new_empty(g0.shape, dtype=state), b0.new_empty(b0.shape, dtype=state), *kept)  # fmt: skip


soe_scan_op = scan_op(
    "soe_scan",
    "Tensor q, Tensor k, Tensor v, Tensor coef, Tensor log_lam, Tensor g0, Tensor b0, int chunk_size, Tensor? reset, "
    "int fast_terms",
    _function, _fake, outputs=4, differentiable=range(7), kept=2,
)
"""(o, z, final G, final b, span states, per-chunk states) of :func:`kernels.soe_scan` from the initial
state (g0, b0); the last two are for the backward only."""
