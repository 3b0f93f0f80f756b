"""Sequence parallelism for the scans: a sequence split into consecutive pieces, one per rank.

Both scans are linear in their state, so each rank scans its piece from zero, one all-gather shares
the pieces' final states, and each rank folds the states of earlier ranks into its outputs: the
result equals one scan over the whole sequence, forward and backward, with communication that does
not grow with the length. With document resets a piece holding a reset cuts off what entered it: its
tokens from its first reset on ignore the entering state, and its outgoing state starts at its last reset.
No device tensor is read on the host: the pieces' lengths are static (equal pieces unless given) and
every per-row decision is a mask on the device. What crosses a border over a fixed distance (an
attention window's keys, a convolution's tail) uses the neighbour exchange at the end. docs/kernels.md,
"Sequence parallelism", gives the algorithm and the gradient conventions; docs/sequence_parallel.md how
the models use it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from kernels._common import decay, decay_cutoff, resolve_backend, use_ops, wrap_angle
from kernels.library import scan_op
from kernels.phasor import phasor_scan, slot_phases
from kernels.soe import soe_scan


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group a functional collective takes (the default group for None)."""
    return dist.group.WORLD if group is None else group


def _waited(x: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor: in eager mode it comes back as an
    AsyncCollectiveTensor that waits on first use, and views of it would stay one (and would be
    returned, saved and pickled as one); under torch.compile it is plain already."""
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def _gather_states(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's x stacked [ranks, *x.shape], differentiable: a functional all-gather, whose backward
    is a reduce-scatter, so each rank receives the sum over ranks of the gradients of its own x only."""
    gathered = _waited(funcol.all_gather_single(x.contiguous(), 0, _group(group)))
    return gathered.view(dist.get_world_size(group), *x.shape)


def sum_over_ranks(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of x over the ranks of ``group``, on every rank, differentiable: a loss computed from it
    on each rank sends back to every rank's x the gradients of all of them (N x the gradient of the one
    whole-sequence loss, the convention of the sequence-parallel LM loss: docs/kernels.md): a functional
    all-reduce, whose backward is the same all-reduce of the gradients."""
    return _waited(funcol.all_reduce(x.contiguous(), "sum", _group(group)))


def _piece_lengths(piece_lengths: Sequence[int] | None, seq_len: int, rank: int, size: int) -> list[int]:
    """Every piece's length, known without communication: ``piece_lengths`` when given (checked against
    this rank's piece), else equal pieces as long as this one (how the trainer splits a sequence)."""
    if piece_lengths is None:
        return [seq_len] * size
    lengths = [int(n) for n in piece_lengths]
    if len(lengths) != size or lengths[rank] != seq_len:
        raise ValueError(f"piece_lengths={lengths} does not fit {size} ranks whose rank {rank} holds "
                         f"{seq_len} tokens")
    return lengths


class _Pieces:
    """What every rank knows of every piece: its length (static, from :func:`_piece_lengths`) and, with
    resets, per batch row whether it holds one (one all-gather, kept on the device). ``reaches(source)``
    weighs the state leaving piece ``source`` (or, for source -1, the initial state) by whether it reaches
    this rank's piece: it comes earlier and no piece in between holds a reset (a piece's own reset is
    already in its local state)."""

    def __init__(
        self,
        reset: torch.Tensor | None,
        seq_len: int,
        piece_lengths: Sequence[int] | None,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.lengths = _piece_lengths(piece_lengths, seq_len, self.rank, size)
        self.has_reset = None  # [ranks, B] bool on the device; None: no piece has a reset
        if reset is not None:
            mine = reset.any(1).long()
            self.has_reset = _waited(funcol.all_gather_single(mine, 0, _group(group))).view(size, -1).bool()

    def reaches(self, source: int) -> torch.Tensor | float:
        """Weight of the state leaving piece ``source`` (-1: the initial state) here: bool [B], or a number
        for every row (1.0 without resets, 0.0 for this piece and later ones)."""
        if source >= self.rank:
            return 0.0
        if self.has_reset is None:
            return 1.0
        return ~self.has_reset[source + 1 : self.rank].any(0)

    def leaves_entering(self) -> torch.Tensor | float:
        """Weight of the entering state in the state leaving this piece: 0 in rows where it holds a reset."""
        return 1.0 if self.has_reset is None else ~self.has_reset[self.rank]

    def tokens_between(self, source: int) -> int:
        """Tokens after piece ``source`` (-1: none yet) and before this rank's piece."""
        return sum(self.lengths[source + 1 : self.rank])


def _row_weight(weight: torch.Tensor | float, like: torch.Tensor, dims: int) -> torch.Tensor | float:
    """``weight`` (bool [B] or a number) as a factor for a tensor [B, ...] with ``dims`` trailing dims."""
    if isinstance(weight, float):
        return weight
    return weight.to(like.dtype).reshape(-1, *([1] * dims))


def _before_first_reset(reset: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: the tokens of a piece before its first reset, the only ones that read the state entering
    the piece."""
    return reset.cumsum(1) == 0


class _SoeStateCorrection(torch.autograd.Function):
    """(o, z) contributions of an entering state: o_t = sum_s lam_s^(t+1) q_t^T G_s, z_t likewise with b.

    Computed chunk by chunk without keeping the [c, S*F] scaled queries: backward rebuilds them. b rides
    along as column D+1 of G, so each chunk is one product forward and two backward. On the CPU a term
    whose decay is exactly 0 over a whole chunk (:func:`kernels._common.decay` flushes factors below its
    cutoff) is left out of that chunk's products: deep into a piece only the slow terms still read the
    entering state, which is about half the work at VORT's decays and 16k-token pieces. Elsewhere every
    term enters every chunk (a flushed one adds exact zeros): choosing the live terms reads the decays,
    which on a GPU is a host sync inside the step.
    """

    @staticmethod
    def prepare_backward(ctx, q, log_lam, g_in, b_in, chunk) -> torch.Tensor:
        """Save what the backward reads (q, the decays, the state with b as its last column) and return
        that state."""
        state = torch.cat((g_in, b_in[..., None]), -1)  # [B, H, S, F, D+1]
        ctx.save_for_backward(q, log_lam, state)
        ctx.chunk = chunk
        return state

    @staticmethod
    def forward(ctx, q, log_lam, g_in, b_in, chunk):
        dtype = g_in.dtype
        B, T, H, _ = q.shape
        D = g_in.shape[-1]
        out = q.new_zeros(B, T, H, D + 1, dtype=dtype)
        state = _SoeStateCorrection.prepare_backward(ctx, q, log_lam, g_in, b_in, chunk)
        live = _LiveState(state)
        for start, stop, terms in _chunks_with_live_terms(log_lam, T, chunk, dtype):
            if terms is None:  # no term reaches this chunk or any later one
                break
            qd = _scaled_queries(q, log_lam[:, terms], start, stop, dtype)  # [B, H, c, A*F]
            out[:, start:stop] = (qd @ live.rows(terms)).transpose(1, 2)
        return out[..., :D].contiguous(), out[..., D].contiguous()

    @staticmethod
    def backward(ctx, d_o, d_z):
        q, log_lam, state_in = ctx.saved_tensors
        dtype = state_in.dtype
        B, T, H, F_ = q.shape
        D = state_in.shape[-1] - 1
        d_out = torch.cat((d_o.to(dtype), d_z.to(dtype)[..., None]), -1).transpose(1, 2)  # [B, H, T, D+1]
        d_q = torch.zeros(B, T, H, F_, dtype=dtype, device=q.device)
        live = _LiveState(state_in)
        d_log_lam = torch.zeros(log_lam.shape, dtype=dtype, device=q.device)
        for start, stop, terms in _chunks_with_live_terms(log_lam, T, ctx.chunk, dtype):
            if terms is None:
                break
            state = live.rows(terms)  # [B, H, A*F, D+1]
            c, n_live = stop - start, state.shape[2] // F_
            scale = _entering_decay(log_lam[:, terms], start, stop, dtype)  # [H, c, A]
            qc = q[:, start:stop].to(dtype).transpose(1, 2)  # [B, H, c, F]
            qd = (qc[:, :, :, None, :] * scale[None, ..., None]).reshape(B, H, c, n_live * F_)
            dout = d_out[:, :, start:stop]
            live.grad(terms).baddbmm_(qd.transpose(-1, -2).flatten(0, 1), dout.flatten(0, 1))
            d_qd = (dout @ state.transpose(-1, -2)).view(B, H, c, n_live, F_)
            d_q[:, start:stop] = (d_qd * scale[None, ..., None]).sum(3).transpose(1, 2)
            if not ctx.needs_input_grad[1]:  # VORT's decays are fixed buffers
                continue
            # d scale[h, t, s] = sum_{b, f} q d_qd; scale = lam^(t+1), so d log_lam += (t+1) scale d scale
            d_scale = (qc[:, :, :, None, :] * d_qd).sum((0, 4))  # [H, c, A]
            steps = torch.arange(start + 1, stop + 1, dtype=dtype, device=q.device)[None, :, None]
            d_log_lam[:, terms] += (d_scale * scale * steps).sum(1)
        d_state = live.total_grad()
        d_log_lam = d_log_lam.to(log_lam.dtype) if ctx.needs_input_grad[1] else None
        return d_q.to(q.dtype), d_log_lam, d_state[..., :D], d_state[..., D], None


def _entering_function(backend: str) -> Any:
    if backend == "triton":
        from kernels.soe.triton import SoeEnteringTriton

        return SoeEnteringTriton
    return _SoeStateCorrection


def _entering_fake(q, log_lam, g_in, b_in, chunk_size, backend) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq_len, heads, _ = q.shape
    return (q.new_empty(batch, seq_len, heads, g_in.shape[-1], dtype=g_in.dtype),
            q.new_empty(batch, seq_len, heads, dtype=g_in.dtype))  # fmt: skip


soe_entering_op = scan_op(
    "soe_entering", "Tensor q, Tensor log_lam, Tensor g_in, Tensor b_in, int chunk_size", _entering_function,
    _entering_fake, outputs=2, differentiable=range(4),
    arguments=lambda inputs, backend: inputs[:4] if backend == "triton" else inputs,  # Triton reads no chunk size
)
"""The (o, z) contributions of a state (g_in, b_in) entering a sequence-parallel piece, as a custom op
(kernels/library.py) that torch.compile keeps in its graph."""


class _LiveState:
    """The entering state [B, H, S, F, D+1] restricted to the live terms, as [B, H, A*F, D+1] rows, and its
    gradient: both are rebuilt only when the set of live terms changes (it only shrinks along a piece)."""

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state
        self.d_state = torch.zeros_like(state)
        self._terms: slice | torch.Tensor | None = None
        self._rows = self._d_rows = None

    def _select(self, terms: slice | torch.Tensor) -> None:
        if terms is self._terms:  # the chunk iterator hands out one object per live set
            return
        self._flush()
        self._terms = terms
        self._rows = self.state[:, :, terms].flatten(2, 3)
        self._d_rows = None

    def _flush(self) -> None:
        if self._d_rows is not None:
            B, H = self.state.shape[:2]
            self.d_state[:, :, self._terms] += self._d_rows.view(B, H, -1, *self.state.shape[3:])

    def rows(self, terms: slice | torch.Tensor) -> torch.Tensor:
        self._select(terms)
        return self._rows

    def grad(self, terms: slice | torch.Tensor) -> torch.Tensor:
        """The gradient of :meth:`rows` as [B*H, A*F, D+1], to accumulate into in place."""
        self._select(terms)
        if self._d_rows is None:
            self._d_rows = torch.zeros_like(self._rows).flatten(0, 1)
        return self._d_rows

    def total_grad(self) -> torch.Tensor:
        self._flush()
        self._d_rows = None
        return self.d_state


def _chunks_with_live_terms(
    log_lam: torch.Tensor, seq_len: int, chunk: int, dtype: torch.dtype
) -> Iterator[tuple[int, int, slice | torch.Tensor | None]]:
    """(start, stop, terms) per chunk of a piece: the terms whose decay lam^(t+1) is non-zero somewhere in
    the chunk for some head (a full slice while that is all of them; None once it is none of them). The
    same object comes back for as long as the live set stays the same. Decided from a numpy view of CPU
    decays (host memory: no sync); decays on another device give every term to every chunk."""
    if log_lam.device.type != "cpu":
        for start in range(0, seq_len, chunk):
            yield start, min(seq_len, start + chunk), _EVERY_TERM
        return
    log_power = log_lam.detach().to(dtype).numpy()
    cutoff = decay_cutoff(dtype)
    previous, terms = None, None
    for start in range(0, seq_len, chunk):
        live = ((start + 1) * log_power >= cutoff).any(0)  # a chunk's first token decays least
        if previous is None or not np.array_equal(live, previous):
            terms = _EVERY_TERM if live.all() else torch.from_numpy(live.nonzero()[0]) if live.any() else None
            previous = live
        yield start, min(seq_len, start + chunk), terms


_EVERY_TERM = slice(None)


def _entering_decay(log_lam: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """lam^(t+1) for piece positions t in [start, stop): [H, c, S]."""
    steps = torch.arange(start + 1, stop + 1, dtype=dtype, device=log_lam.device)
    return decay(steps[None, :, None] * log_lam.to(dtype)[:, None, :])


def _scaled_queries(q: torch.Tensor, log_lam: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    B, _, H, _ = q.shape
    scale = _entering_decay(log_lam, start, stop, dtype)  # [H, c, S]
    qc = q[:, start:stop].to(dtype).transpose(1, 2)  # [B, H, c, F]
    return (qc[:, :, :, None, :] * scale[None, ..., None]).reshape(B, H, stop - start, -1)


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
    reset: torch.Tensor | None = None,
    piece_lengths: Sequence[int] | None = None,
    fast_terms: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`kernels.soe_scan` over a sequence split across the ranks of ``group`` (this rank's piece
    in q, k, v, coef and ``reset``, bool [B, T_piece]; log_lam the same everywhere). Returns this piece's
    (o, z, state after it). ``piece_lengths`` gives every rank's piece length (default: equal pieces):
    the decays between pieces are computed from it, never read from the other ranks. With ``reset`` the
    state entering a piece is the sum of the earlier pieces' local states (decayed) from the last piece
    with a reset on, plus the initial state only if no earlier piece has one; it reaches only the tokens
    before the piece's first reset, and the state leaving a piece with a reset is its local state.
    ``fast_terms``: as :func:`kernels.soe_scan`'s, for the local scan."""
    size = dist.get_world_size(group)
    o, z, (g_local, b_local) = soe_scan(q, k, v, coef, log_lam, None, True, chunk_size, backend, reset=reset,
                                        fast_terms=fast_terms)
    pieces = _Pieces(reset, q.shape[1], piece_lengths, group)
    g_all = _gather_states(g_local, group)
    b_all = _gather_states(b_local, group)
    log_decay = log_lam.to(g_local.dtype)

    def decayed(tokens: int, weight: torch.Tensor | float, g: torch.Tensor, b: torch.Tensor):
        """(g, b) decayed by lambda^tokens, times ``weight`` (per row [B], or one number)."""
        factor = decay(tokens * log_decay)[None, :, :, None] * _row_weight(weight, log_decay, 3)  # [B|1, H, S, 1]
        return g * factor[..., None], b * factor

    if initial_state is None:
        g_in, b_in = torch.zeros_like(g_local), torch.zeros_like(b_local)
    else:
        g0, b0 = (x.to(g_local.dtype) for x in initial_state)
        g_in, b_in = decayed(pieces.tokens_between(-1), pieces.reaches(-1), g0, b0)
    # Every rank's state enters the sum, with weight 0 from this rank on (and behind a reset): each rank
    # then takes part in the gather's backward (a reduce-scatter), also rank 0, which needs no other state.
    for source in range(size):
        g, b = decayed(pieces.tokens_between(source), pieces.reaches(source), g_all[source], b_all[source])
        g_in, b_in = g_in + g, b_in + b
    reads = q if reset is None else q * _before_first_reset(reset)[..., None, None]
    which = resolve_backend(backend, q)
    if use_ops():
        o_in, z_in = soe_entering_op(reads, log_lam, g_in, b_in, chunk_size, which)
    elif which == "triton":
        from kernels.soe.triton import SoeEnteringTriton

        o_in, z_in = SoeEnteringTriton.apply(reads, log_lam, g_in, b_in)
    else:
        o_in, z_in = _SoeStateCorrection.apply(reads, log_lam, g_in, b_in, chunk_size)
    o, z = o + o_in.to(o.dtype), z + z_in.to(z.dtype)
    if not output_final_state:
        return o, z, None
    g_out, b_out = decayed(q.shape[1], pieces.leaves_entering(), g_in, b_in)
    return o, z, (g_local + g_out, b_local + b_out)


def phasor_scan_sequence_parallel(
    delta: torch.Tensor,
    slots: torch.Tensor,
    n_slots: int,
    group: dist.ProcessGroup | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`kernels.phasor_scan` over a sequence split across the ranks of ``group`` (this rank's
    piece in delta, slots and ``reset``, bool [B, T_piece]). Returns this piece's (read, phases after it).
    Phases add, and a reset restarts from zero (as in :func:`kernels.phasor_scan`): a piece enters with
    the local phases of the earlier pieces from the last one with a reset on, plus ``initial_state`` only
    if no earlier piece has a reset; tokens from its first reset on read only their own piece's phases,
    and a piece with a reset leaves its local phases. Phases do not decay, so the pieces' lengths do
    not enter."""
    read, local = phasor_scan(delta, slots, n_slots, None, True, backend, reset=reset)
    pieces = _Pieces(reset, delta.shape[1], None, group)
    totals = _gather_states(local, group)
    entering = torch.zeros_like(local)
    if initial_state is not None:
        entering = _row_weight(pieces.reaches(-1), local, 2) * initial_state.to(local.dtype)
    for source in range(dist.get_world_size(group)):  # weight 0 from this rank on, as in the SOE scan
        entering = entering + _row_weight(pieces.reaches(source), local, 2) * totals[source]
    entering_read = slot_phases(entering, slots)
    if reset is not None:
        entering_read = entering_read * _before_first_reset(reset)[..., None, None]
        entering = entering * _row_weight(pieces.leaves_entering(), local, 2)
    read = wrap_angle(read + entering_read.to(read.dtype))  # wrap counts as the identity for gradients
    return read, (wrap_angle(local + entering) if output_final_state else None)


# ----------------------------------------------------------------------------- neighbour exchange


def exchange_with_neighbours(
    x: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Send x to the next rank of ``group`` and receive the previous rank's (same shape): returns
    (x to use from here on, the previous rank's x or None on the first rank).

    One functional all-to-all in which each rank sends x to itself and to the next rank; its backward
    sends the gradients the other way. Use the returned x (the copy sent to itself) in place of the
    argument: every rank then reaches the all-to-all's backward, also the first, which receives nothing.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    n = x.numel()
    send = [n if r in (rank, rank + 1) else 0 for r in range(size)]
    receive = [n if r in (rank - 1, rank) else 0 for r in range(size)]
    flat = x.reshape(-1)
    outgoing = torch.cat((flat, flat)) if rank + 1 < size else flat  # one copy per destination, in rank order
    out = _waited(funcol.all_to_all_single(outgoing, receive, send, _group(group)))
    if rank == 0:
        return out.view_as(x), None
    return out[n:].view_as(x), out[:n].view_as(x)
