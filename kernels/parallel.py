"""Sequence parallelism for the scans: a sequence split into consecutive pieces, one per rank.

Rank r of the process group holds tokens [T_0 + ... + T_{r-1}, T_0 + ... + T_r) of every sequence
(any lengths T_r, rank order = sequence order). Both scans are linear in their state, so a rank's
entering state is a combination of the other ranks' local states (LASP-2's scheme):

1. each rank scans its piece from a zero state and keeps only the local final state;
2. one all-gather of those states (one per rank: SOE [B, H, S, F, D] + [B, H, S, F], phasor
   [B, n_slots, M]; the sequence length does not enter);
3. rank r combines the states of ranks < r (SOE: each decayed by lambda^(tokens between);
   phasor: summed mod 2*pi) with the initial state, and scans its piece again from there.

The result equals one scan over the whole sequence, forward and backward: gradients reach earlier
ranks through the all-gather, whose backward sums each state's gradients over the ranks that used it
(one all-reduce). The price is a second local scan; the communication is one state per rank, not
activations. ``initial_state`` (the state before rank 0's piece) must be the same on every rank; as
for a replicated parameter, each rank's gradient for it holds that rank's share, and their sum over
the group is the whole gradient. The returned final state is the state after this rank's piece (the
sequence's final state is the last rank's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels._common import wrap_angle
from kernels.phasor import phasor_scan
from kernels.soe import soe_scan
from kernels.soe.chunk import decay


class _GatherStates(torch.autograd.Function):
    """all_gather with a backward that sums, over ranks, the gradients of each rank's tensor."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        stacked = torch.stack([torch.zeros_like(g) if g is None else g for g in grads])
        dist.all_reduce(stacked, group=ctx.group)
        return None, stacked[dist.get_rank(ctx.group)]


def _piece_lengths(seq_len: int, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    mine = torch.tensor([seq_len], dtype=torch.long, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t) for t in every]


def soe_scan_sequence_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    log_lam: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`kernels.soe_scan` over a sequence split across the ranks of ``group`` (this rank's piece
    in q, k, v, coef; log_lam the same everywhere). Returns this piece's (o, z, state after it)."""
    rank = dist.get_rank(group)
    _, _, (g_local, b_local) = soe_scan(q, k, v, coef, log_lam, None, True, chunk_size, backend)
    lengths = _piece_lengths(q.shape[1], group, q.device)
    g_all = _GatherStates.apply(group, g_local)
    b_all = _GatherStates.apply(group, b_local)
    log_decay = log_lam.to(g_local.dtype)

    def decayed(tokens: int, g: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        factor = decay(tokens * log_decay)[None, :, :, None]  # lambda^tokens: [1, H, S, 1]
        return g * factor[..., None], b * factor

    if initial_state is None:
        g_in, b_in = torch.zeros_like(g_local), torch.zeros_like(b_local)
    else:
        g0, b0 = (x.to(g_local.dtype) for x in initial_state)
        g_in, b_in = decayed(sum(lengths[:rank]), g0, b0)
    # Every rank's state enters the sum, with weight 0 from this rank on: each rank then takes part in
    # the gather's backward (an all-reduce), also rank 0, which needs no other state.
    for source in range(dist.get_world_size(group)):
        weight = 1.0 if source < rank else 0.0
        g, b = decayed(sum(lengths[source + 1 : rank]), g_all[source], b_all[source])
        g_in, b_in = g_in + weight * g, b_in + weight * b
    return soe_scan(q, k, v, coef, log_lam, (g_in, b_in), output_final_state, chunk_size, backend)


def phasor_scan_sequence_parallel(
    delta: torch.Tensor,
    slots: torch.Tensor,
    n_slots: int,
    group: dist.ProcessGroup | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kernels.phasor_scan` over a sequence split across the ranks of ``group`` (this rank's
    piece in delta and slots). Returns this piece's (read, phases after it)."""
    rank = dist.get_rank(group)
    _, local = phasor_scan(delta, slots, n_slots, None, True, backend)
    totals = _GatherStates.apply(group, local)
    entering = torch.zeros_like(local) if initial_state is None else initial_state.to(local.dtype)
    for source in range(dist.get_world_size(group)):  # weight 0 from this rank on, as in the SOE scan
        entering = entering + (1.0 if source < rank else 0.0) * totals[source]
    entering = wrap_angle(entering)  # wrap counts as the identity for gradients
    return phasor_scan(delta, slots, n_slots, entering, output_final_state, backend)
