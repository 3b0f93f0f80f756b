"""Segmented PyTorch phasor scan: the CPU path, with a hand-written backward.

All (token, level) entries are sorted once by (batch, slot, token). In that order every slot is one
contiguous segment, and a token's read is an exclusive prefix sum inside its segment:
read = wrap(init[slot] + (cumsum - own increment - the cumsum before the segment)). The sums run in
float64, which keeps the phase exact to ~1e-10 rad even for millions of increments, and are wrapped
before returning to fp32. Memory is O(T * L * M); nothing of size T x n_slots is built.

The backward is the mirror image: the gradient of an increment is the sum of the read gradients of
the same slot at later tokens (a reverse exclusive segmented sum) plus the final-state gradient of its
slot; wrap has derivative 1.
"""

from __future__ import annotations

import torch

from kernels._common import wrap_angle


class SlotSegments:
    """The sort of entries by (batch, slot, token) and each entry's segment bounds in that order."""

    def __init__(self, slots: torch.Tensor, n_slots: int) -> None:
        batch, seq_len, _ = slots.shape
        dev = slots.device
        tok = torch.arange(seq_len, device=dev)[None, :, None]
        seg = torch.arange(batch, device=dev)[:, None, None] * n_slots + slots.long()
        key = (seg * seq_len + tok).flatten()
        self.order = torch.argsort(key)
        self.seg = seg.flatten().index_select(0, self.order)
        n = self.seg.numel()
        idx = torch.arange(n, device=dev)
        boundary = self.seg[1:] != self.seg[:-1]
        is_start = torch.cat([boundary.new_ones(1), boundary])
        is_end = torch.cat([boundary, boundary.new_ones(1)])
        self.start = torch.cummax(torch.where(is_start, idx, 0), 0).values
        self.stop = torch.cummin(torch.where(is_end, idx, n).flip(0), 0).values.flip(0)
        self.last = idx[is_end]
        self.last_seg = self.seg[is_end]
        self.n_states = batch * n_slots

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, L, M] -> float64 [M, N] in segment order (scans run along the contiguous last dim)."""
        rows = x.reshape(-1, x.shape[-1]).index_select(0, self.order)
        return torch.empty(rows.shape[::-1], dtype=torch.float64, device=x.device).copy_(rows.t())

    def scatter(self, x: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`gather`, cast to ``dtype`` and viewed as ``shape``."""
        rows = x.to(dtype).t()
        return torch.empty(rows.shape, dtype=dtype, device=x.device).index_copy_(0, self.order, rows).view(shape)

    def per_entry(self, state: torch.Tensor) -> torch.Tensor:
        """[B*n_slots, M] -> [M, N]: each entry's slot row."""
        return state.t().index_select(1, self.seg)

    def segment_totals(self, inclusive: torch.Tensor, values: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """base [B*n_slots, M] plus the sum of ``values`` [M, N] over each segment (``inclusive``: their cumsum)."""
        first = self.start.index_select(0, self.last)
        totals = inclusive.index_select(1, self.last) - inclusive.index_select(1, first) + values.index_select(1, first)
        return base.index_add(0, self.last_seg, totals.t())


def phasor_forward_segmented(
    delta: torch.Tensor, seg: SlotSegments, init: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (read [B, T, L, M] in delta's dtype, final state [B, n_slots, M] fp32), both wrapped."""
    d = seg.gather(delta)
    incl = torch.cumsum(d, 1)
    excl = incl - d
    base = init.reshape(seg.n_states, -1).double()
    read = wrap_angle(seg.per_entry(base) + (excl - excl.index_select(1, seg.start)))
    final = wrap_angle(seg.segment_totals(incl, d, base))
    return seg.scatter(read, delta.shape, delta.dtype), final.float().view(init.shape)


def phasor_backward_segmented(
    d_read: torch.Tensor | None,
    d_final: torch.Tensor | None,
    seg: SlotSegments,
    shape: torch.Size,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (d delta [shape] in ``dtype``, d initial_state fp32) of <d_read, read> + <d_final, final>."""
    batch, width = shape[0], shape[-1]
    base = torch.zeros(seg.n_states, width, dtype=torch.float64, device=seg.seg.device)
    if d_final is not None:
        base = base + d_final.reshape(seg.n_states, width).double()
    if d_read is None:
        d_delta = seg.per_entry(base)
        d_init = base
    else:
        g = seg.gather(d_read)
        incl = torch.cumsum(g, 1)
        d_delta = seg.per_entry(base) + (incl.index_select(1, seg.stop) - incl)
        d_init = seg.segment_totals(incl, g, base)
    return seg.scatter(d_delta, shape, dtype), d_init.float().view(batch, -1, width)


class PhasorScanSegmented(torch.autograd.Function):
    """Autograd wrapper: saves the sort (integers) only; the backward needs no forward activations."""

    @staticmethod
    def forward(ctx, delta, slots, n_slots, init):
        seg = SlotSegments(slots, n_slots)
        read, final = phasor_forward_segmented(delta, seg, init)
        ctx.seg = seg
        ctx.meta = (delta.shape, delta.dtype, init.dtype)
        ctx.set_materialize_grads(False)
        return read, final

    @staticmethod
    def backward(ctx, d_read, d_final):
        shape, dtype, init_dtype = ctx.meta
        d_delta, d_init = phasor_backward_segmented(d_read, d_final, ctx.seg, shape, dtype)
        return d_delta, None, None, d_init.to(init_dtype)
