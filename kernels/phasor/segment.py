"""Segmented PyTorch phasor scan: the CPU path, with a hand-written backward.

All (token, level) entries are sorted once by (batch, slot, token); in that order each slot is one
contiguous segment and a token's read is an exclusive prefix sum inside its segment. One cumsum over
the whole sorted array does every segment at once: the running sum is reset between segments by adding
reset_k = init_k - (init_{k-1} + total_{k-1}) with the last entry of segment k - 1, so inside segment
k it equals init_k + (the segment's increments so far). Resets are taken mod 2*pi (reads are wrapped
anyway), which keeps the running sum small. Sums run in float64 along the contiguous axis of an
[M, N] array and in place where possible (fresh large buffers cost page faults); phases stay exact to
~1e-10 rad for millions of increments and are wrapped and returned in fp32. Memory is O(T * L * M);
nothing of size T x n_slots is built.

The backward is one more cumsum: the gradient of an increment is the final-state gradient of its slot
plus the read gradients of the same slot at later tokens; wrap has derivative 1.

Resets (bool [B, T], every slot zeroed before a document's first token reads) split segments further:
a segment is one slot's entries in one document (document numbers rise with the token, so the sort does
not change). Only segments of a row's first document start from the initial state (the others from
zero), and only those of its last document reach the final state.
"""

from __future__ import annotations

import torch

from kernels._common import document_numbers, wrap_angle


class SlotSegments:
    """The sort of entries by (batch, slot, token), and where each segment (one slot's entries in one
    document) starts and ends in it; ``reset`` (bool [B, T] or None) marks document starts."""

    def __init__(self, slots: torch.Tensor, n_slots: int, reset: torch.Tensor | None = None) -> None:
        batch, seq_len, _ = slots.shape
        dev = slots.device
        state = torch.arange(batch, device=dev)[:, None, None] * n_slots + slots.long()
        key = (state * seq_len + torch.arange(seq_len, device=dev)[None, :, None]).flatten()
        self.order = torch.argsort(key)
        state = state.flatten().index_select(0, self.order)
        docs = document_numbers(reset, batch, seq_len, dev, torch.long)
        doc = docs[:, :, None].expand(slots.shape).flatten().index_select(0, self.order)
        boundary = (state[1:] != state[:-1]) | (doc[1:] != doc[:-1])
        idx = torch.arange(state.numel(), device=dev)
        self.starts = idx[torch.cat([boundary.new_ones(1), boundary])]
        self.ends = idx[torch.cat([boundary, boundary.new_ones(1)])]
        self.segment_of = torch.cat([boundary.new_zeros(1, dtype=torch.long), boundary.long().cumsum(0)])
        self.slot_of_segment = state.index_select(0, self.starts)  # batch * n_slots + slot
        self.n_states = batch * n_slots
        doc_of_segment = doc.index_select(0, self.starts)
        self.first = doc_of_segment == 0  # starts from the initial state
        self.last = doc_of_segment == docs[:, -1].index_select(0, self.slot_of_segment // n_slots)  # reaches the end
        # per state row: 1 if its row has no reset (the initial state itself reaches the final state)
        self.kept = (docs[:, -1] == 0).double().repeat_interleave(n_slots)[:, None]

    def sorted_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, L, M] -> float64 [N, M] in segment order."""
        return x.reshape(-1, x.shape[-1]).index_select(0, self.order).double()

    def unsort(self, cols: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """[M, N] in segment order -> ``shape`` in token order, cast to ``dtype``."""
        rows = torch.empty(cols.shape[::-1], dtype=dtype, device=cols.device).copy_(cols.t())
        return torch.empty_like(rows).index_copy_(0, self.order, rows).view(shape)

    def totals(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-segment sums of [N, M] rows: [n_segments, M]."""
        return rows.new_zeros(self.starts.numel(), rows.shape[1]).index_add_(0, self.segment_of, rows)

    def per_segment(self, state: torch.Tensor) -> torch.Tensor:
        """[B, n_slots, M] -> float64 [n_segments, M]: the rows of the slots that have a segment."""
        return state.reshape(self.n_states, -1).double().index_select(0, self.slot_of_segment)


def phasor_forward_segmented(
    delta: torch.Tensor, seg: SlotSegments, init: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (read [B, T, L, M] in delta's dtype, final state [B, n_slots, M] fp32), both wrapped."""
    rows = seg.sorted_rows(delta)
    totals = seg.totals(rows)
    init_seg = seg.per_segment(init) * seg.first[:, None]
    # An exclusive scan: column 0 holds segment 0's start value and entry i sits in column i + 1, so
    # column i of the inclusive cumsum is the phase before entry i. The reset of segment k is added
    # with the last entry of segment k - 1.
    run = rows.new_empty(rows.shape[1], rows.shape[0] + 1)
    run[:, 1:].copy_(rows.t())
    run[:, 0] = init_seg[0]
    resets = init_seg[1:] - init_seg[:-1] - totals[:-1]
    run[:, seg.ends[:-1] + 1] += wrap_angle(resets).t()
    read = wrap_angle(run.cumsum_(1)[:, :-1], inplace=True)
    final = wrap_angle(init.reshape(seg.n_states, -1).double()) * seg.kept
    final[seg.slot_of_segment[seg.last]] = wrap_angle(init_seg + totals)[seg.last]
    return seg.unsort(read, delta.shape, delta.dtype), final.float().view(init.shape)


def phasor_backward_segmented(
    d_read: torch.Tensor | None,
    d_final: torch.Tensor | None,
    seg: SlotSegments,
    shape: torch.Size,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (d delta [shape] in ``dtype``, d initial_state fp32) of <d_read, read> + <d_final, final>.

    d delta_i = d_final[slot] + sum of d_read over the later entries of its segment
              = (d_final[slot] + segment total) - (sum of d_read up to and including i),
    one cumsum of -d_read with a reset at each segment start.
    """
    batch, width = shape[0], shape[-1]
    dev = seg.order.device
    if d_final is None:
        d_final = torch.zeros(batch, seg.n_states // batch, width, dtype=torch.float64, device=dev)
    if d_read is None:
        rows = torch.zeros(seg.order.numel(), width, dtype=torch.float64, device=dev)
    else:
        rows = seg.sorted_rows(d_read).neg_()
    final_seg = seg.per_segment(d_final) * seg.last[:, None]
    whole = final_seg - seg.totals(rows)  # d_final + segment total of d_read = the gradient of the initial state
    resets = whole.clone()
    resets[1:] -= final_seg[:-1]  # the running sum ends segment k - 1 at d_final[k - 1]
    rows.index_add_(0, seg.starts, resets)
    d_delta = rows.t().contiguous().cumsum_(1)
    d_init = d_final.reshape(seg.n_states, -1).double() * seg.kept
    d_init[seg.slot_of_segment[seg.first]] = whole[seg.first]
    return seg.unsort(d_delta, shape, dtype), d_init.float().view(batch, -1, width)


PIECE_VALUES = 1 << 20  # increments per piece: keeps every float64 temporary near 8 MB


def _pieces(delta: torch.Tensor) -> list[slice]:
    """Token ranges processed one after another, carrying the state: the scan is exact across pieces, and
    small pieces keep temporaries in cache and below the allocator's mmap threshold (fresh large buffers
    cost page faults)."""
    batch, seq_len, levels, width = delta.shape
    step = max(1, PIECE_VALUES // (batch * levels * width))
    return [slice(lo, min(lo + step, seq_len)) for lo in range(0, seq_len, step)]


class PhasorScanSegmented(torch.autograd.Function):
    """Autograd wrapper: saves the sorts (integers) only; the backward needs no forward activations.
    ``reset`` (bool [B, T] or None) zeroes every slot before a document's first token reads; a zeroed
    state carries across pieces like any other."""

    @staticmethod
    def forward(ctx, delta, slots, n_slots, init, reset=None):
        pieces = _pieces(delta)
        read = torch.empty_like(delta)
        segs, state = [], init
        for piece in pieces:
            seg = SlotSegments(slots[:, piece], n_slots, None if reset is None else reset[:, piece])
            read[:, piece], state = phasor_forward_segmented(delta[:, piece], seg, state)
            segs.append(seg)
        ctx.segs, ctx.pieces = segs, pieces
        ctx.meta = (delta.shape, delta.dtype, init.dtype)
        ctx.set_materialize_grads(False)
        return read, state.float()

    @staticmethod
    def backward(ctx, d_read, d_final):
        shape, dtype, init_dtype = ctx.meta
        d_delta = torch.empty(shape, dtype=dtype, device=ctx.segs[0].order.device)
        d_state = d_final
        for piece, seg in zip(reversed(ctx.pieces), reversed(ctx.segs)):
            piece_read = None if d_read is None else d_read[:, piece]
            piece_shape = d_delta[:, piece].shape
            d_delta[:, piece], d_state = phasor_backward_segmented(piece_read, d_state, seg, piece_shape, dtype)
        return d_delta, None, None, d_state.to(init_dtype), None
