"""Triton kernels for the phasor scan (the CUDA path; also runs under TRITON_INTERPRET=1 on CPU tensors).

One program per (batch, block of phase columns x block of BN slots, span) keeps its slots' phases
[BN, BM] in registers, in fp32, wrapped to [0, 2*pi) after each chunk, and walks its span in chunks of
BT tokens, starting from the phases entering the span (per-span increment sums and a prefix sum over the
spans, kernels/span.py, give those first). A (token, level) entry belongs to the one slot block that
holds its slot: only that program loads its row (the others' loads of it are masked off, so each
increment row is read once; its 4-byte slot id is read by every slot block), computes its read or
gradient and stores it, so every output element has one writer; a program skips a level in a chunk
where none of the chunk's entries falls in its block. Slot blocks keep a large tree (the 1,365 slots of
depth 5) within one program's registers and shared memory. Per chunk and level, with
onehot[t, n] = (slots[t] == n) over the block's slots n:
  read  = wrap(onehot @ state + same_slot_before @ delta),  same_slot_before[t, j] = (slot_t == slot_j and j < t)
  state += onehot^T @ delta
Levels never share a slot, so updating the state level by level does not change the next level's reads.
The backward is the same in reverse with the read gradients: d delta = onehot @ g + same_slot_after @ d_read.
The products run on tensor cores without giving up fp32: the 0/1 operand is exact in tf32 and the fp32
one is split into three tf32 pieces that sum to it exactly (_select_dot), so each product is exact and
only the fp32 accumulation rounds (benchmarks/scan_precision.py measures the phase error by length).

Resets (bool [B, T]) zero every slot's phases before a document's first token reads: with the tokens'
document numbers (kernels.span.chunk_documents) a token reads the entering phases only before the chunk's
first reset, same_slot_before also needs the same document, only the chunk's last document writes the
phases it leaves, and the entering phases pass through only a chunk (and, in the span pass, a span)
without a reset. Restarting from the initial state instead of zero is kernels.phasor.phasor_scan's job.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import Launch, check_triton_inputs, device_capability, document_numbers, triton_type
from kernels.span import (
    chunk_documents,
    chunk_start,
    span_carry,
    span_chunks,
    span_pass_launch,
    wrap_phase,
)


@triton.jit
def _slot_tile(M, NS, SPAN, seq_len, BT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's batch row, phase columns, slot ids (block ``program_id(1) % n_blocks`` of BN slots),
    chunk positions and span [lo, hi) of tokens, and the offsets and mask of its state tile [BN, BM] in
    one [B, NS, M] slot of the span states."""
    b = tl.program_id(0)
    slot_blocks = tl.cdiv(NS, BN)
    offs_m = (tl.program_id(1) // slot_blocks) * BM + tl.arange(0, BM)
    offs_n = (tl.program_id(1) % slot_blocks) * BN + tl.arange(0, BN)
    offs_t = tl.arange(0, BT)
    mask_m = offs_m < M
    st_off = (b * NS + offs_n[:, None]) * M + offs_m[None, :]
    st_mask = (offs_n < NS)[:, None] & mask_m[None, :]
    lo = tl.program_id(2) * SPAN
    hi = tl.minimum(lo + SPAN, seq_len)
    return b, offs_m, offs_n, offs_t, mask_m, st_off, st_mask, lo, hi


@triton.jit
def _slot(states, i, M, NS):
    """Slot ``i`` of the [n_spans + 1, B, NS, M] span states (64-bit offset)."""
    return states + i.to(tl.int64) * tl.num_programs(0) * NS * M


@triton.jit
def _tf32_pieces(x):
    """fp32 ``x`` as hi + mid + lo, each exact in tf32 (hi and mid keep the top 11 significant bits of
    x and of x - hi; lo, the last <= 2 bits, fits too): the tensor cores read every piece unrounded."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # clear the low 13 bits
    rest = x - hi
    mid = (rest.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, mid, rest - mid


@triton.jit
def _select_dot(select, x, acc):
    """``acc + select @ x`` for a 0/1 matrix ``select`` and fp32 ``x`` on tensor cores at fp32 precision:
    select is exact in tf32 and x is split into three tf32 pieces (:func:`_tf32_pieces`), so every
    product is exact. Each piece's dot starts from zero (a sum of up to 16 pieces of 11 bits is exact
    in fp32 while they lie within a factor 2^9 of each other) and the three are added to ``acc`` in
    IEEE fp32: chaining ``acc`` through the dots would round every running sum toward zero, as tensor
    cores do, and bias a phase by up to an ulp per chunk (benchmarks/scan_precision.py measures it)."""
    hi, mid, lo = _tf32_pieces(x)
    small = tl.dot(select, lo, input_precision="tf32") + tl.dot(select, mid, input_precision="tf32")
    return acc + (tl.dot(select, hi, input_precision="tf32") + small)


@triton.jit
def _level_slots(slots, b, t, lvl, seq_len, L, NS, BN: tl.constexpr):
    """Level ``lvl`` of tokens ``t``: flat entry ids, each entry's slot, which entries fall in this
    program's block of slots (:func:`_slot_tile`), and whether any does (else the level is skipped)."""
    mask_t = t < seq_len
    entry = ((b * seq_len + t) * L + lvl).to(tl.int64)
    sl = tl.load(slots + entry, mask=mask_t, other=-1)
    mine = mask_t & (sl // BN == tl.program_id(1) % tl.cdiv(NS, BN))
    return entry, sl, mine, tl.max(mine.to(tl.int32), axis=0) > 0


@triton.jit
def _level_rows(values, entry, sl, mine, M, offs_m, offs_n, mask_m):
    """The [BT, BM] mask of this program's entries, their one-hot over the block's slots, and their rows
    of ``values`` (an increment or its gradient) in fp32, zero elsewhere."""
    mask = mine[:, None] & mask_m[None, :]
    rows = tl.load(values + entry[:, None] * M + offs_m[None, :], mask=mask, other=0.0).to(tl.float32)
    onehot = (sl[:, None] == offs_n[None, :]).to(tl.float32)
    return mask, onehot, rows


@triton.jit
def _phasor_span_kernel(
    values,
    slots,
    docs,
    states,
    seq_len,
    SPAN,
    L,
    M,
    NS,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    REVERSE: tl.constexpr,
):
    """Per slot, the sum of one span's rows: its increments after its last reset, wrapped, into slot
    ``span + 1`` (forward: the phases it leaves, from zero), or its read gradients before its first reset
    into slot ``span`` (REVERSE: the gradient its reads give the phases entering it). Chunks run in
    order (forward) or in reverse, and a chunk with a reset drops what came before it."""
    b, offs_m, offs_n, offs_t, mask_m, st_off, st_mask, lo, hi = _slot_tile(M, NS, SPAN, seq_len, BT, BM, BN)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    n_chunks = tl.cdiv(hi - lo, BT)
    for i in range(0, n_chunks):
        start = chunk_start(lo, i, n_chunks, BT, REVERSE)
        doc, entering, last = chunk_documents(docs, b, start, seq_len, BT)
        if REVERSE:
            counted = doc == entering  # reads of the phases entering the chunk
        else:
            counted = doc == last  # increments that reach the phases leaving it
        acc = acc * (last == entering).to(tl.float32)
        for lvl in range(0, L):
            entry, sl, mine, any_mine = _level_slots(slots, b, start + offs_t, lvl, seq_len, L, NS, BN)
            if any_mine:
                _mask, onehot, rows = _level_rows(values, entry, sl, mine & counted, M, offs_m, offs_n, mask_m)
                acc = _select_dot(tl.trans(onehot), rows, acc)
        if not REVERSE:
            acc = wrap_phase(acc)
    if REVERSE:
        tl.store(_slot(states, tl.program_id(2), M, NS) + st_off, acc, mask=st_mask)
    else:
        tl.store(_slot(states, tl.program_id(2) + 1, M, NS) + st_off, acc, mask=st_mask)


@triton.jit
def _phasor_fwd_kernel(
    delta,
    slots,
    docs,
    states,
    read,
    seq_len,
    SPAN,
    L,
    M,
    NS,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """The reads of one span from the phases entering it (slot ``span`` of ``states``). A chunk's levels
    read the phases entering it (levels never share a slot) and their increments are summed apart."""
    b, offs_m, offs_n, offs_t, mask_m, st_off, st_mask, lo, hi = _slot_tile(M, NS, SPAN, seq_len, BT, BM, BN)
    state = tl.load(_slot(states, tl.program_id(2), M, NS) + st_off, mask=st_mask, other=0.0)
    before = offs_t[:, None] > offs_t[None, :]
    for start in range(lo, hi, BT):
        t = start + offs_t
        doc, entering, last = chunk_documents(docs, b, start, seq_len, BT)
        earlier = before & (doc[:, None] == doc[None, :])
        added = tl.zeros([BN, BM], dtype=tl.float32)
        for lvl in range(0, L):
            entry, sl, mine, any_mine = _level_slots(slots, b, t, lvl, seq_len, L, NS, BN)
            if any_mine:
                mask, onehot, d = _level_rows(delta, entry, sl, mine, M, offs_m, offs_n, mask_m)
                same = ((sl[:, None] == sl[None, :]) & earlier).to(tl.float32)
                reads = onehot * (doc == entering).to(tl.float32)[:, None]
                r = _select_dot(reads, state, _select_dot(same, d, tl.zeros([BT, BM], dtype=tl.float32)))
                tl.store(read + entry[:, None] * M + offs_m[None, :], wrap_phase(r), mask=mask)
                added = _select_dot(tl.trans(onehot * (doc == last).to(tl.float32)[:, None]), d, added)
        state = wrap_phase(tl.where(last == entering, state, 0.0) + added)


@triton.jit
def _phasor_bwd_kernel(
    d_read,
    slots,
    docs,
    d_states,
    d_delta,
    seq_len,
    SPAN,
    L,
    M,
    NS,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """The increment gradients of one span, walking it in reverse from the gradient of the phases leaving
    it (slot ``span + 1`` of ``d_states``)."""
    b, offs_m, offs_n, offs_t, mask_m, st_off, st_mask, lo, hi = _slot_tile(M, NS, SPAN, seq_len, BT, BM, BN)
    g_state = tl.load(_slot(d_states, tl.program_id(2) + 1, M, NS) + st_off, mask=st_mask, other=0.0)
    after = offs_t[:, None] < offs_t[None, :]
    n_chunks = tl.cdiv(hi - lo, BT)
    for rev in range(0, n_chunks):
        start = lo + (n_chunks - 1 - rev) * BT
        t = start + offs_t
        doc, entering, last = chunk_documents(docs, b, start, seq_len, BT)
        later = after & (doc[:, None] == doc[None, :])
        added = tl.zeros([BN, BM], dtype=tl.float32)
        for lvl in range(0, L):
            entry, sl, mine, any_mine = _level_slots(slots, b, t, lvl, seq_len, L, NS, BN)
            if any_mine:
                mask, onehot, g = _level_rows(d_read, entry, sl, mine, M, offs_m, offs_n, mask_m)
                same = ((sl[:, None] == sl[None, :]) & later).to(tl.float32)
                writes = onehot * (doc == last).to(tl.float32)[:, None]
                gd = _select_dot(writes, g_state, _select_dot(same, g, tl.zeros([BT, BM], dtype=tl.float32)))
                tl.store(d_delta + entry[:, None] * M + offs_m[None, :], gd, mask=mask)
                added = _select_dot(tl.trans(onehot * (doc == entering).to(tl.float32)[:, None]), g, added)
        g_state = tl.where(last == entering, g_state, 0.0) + added


# Per target: (tokens per chunk, widest block of phase columns, widest block of slots, warps, pipeline
# stages). The compile gate (benchmarks/kernel_compile.py) checks every entry against the target's shared
# memory and registers.
_TABLE: dict[bool, tuple[int, int, int, int, int]] = {
    # sm_90 or newer
    False: (16, 16, 128, 8, 2),
    True: (16, 16, 128, 8, 2),
}


def phasor_launches(
    batch: int, seq_len: int, levels: int, width: int, n_slots: int, dtype: torch.dtype, capability: int
) -> tuple[int, dict[str, Launch]]:
    """(span length, launches) of one scan for increments of ``dtype`` on a GPU of compute capability
    ``capability``. Forward: "fwd_spans" (each span's increments per slot), "fwd_pass" (the phases
    entering each span), "fwd" (the reads); backward: "bwd_spans", "bwd_pass" (in reverse), "bwd".
    Chunk, column and slot blocks are all >= 16 for tl.dot: one slot block of the slot count padded to a
    power of two, or as many blocks of the table's widest as the slots need. Grid axis 1 runs over
    (column block, slot block); spans are whole chunks, as many as reach kernels.span.TARGET_PROGRAMS
    programs."""
    bt, bm_max, bn_max, warps, stages = _TABLE[capability >= 90]
    bm = min(bm_max, max(16, triton.next_power_of_2(width)))
    bn = min(bn_max, max(16, triton.next_power_of_2(n_slots)))
    blocks = triton.cdiv(width, bm) * triton.cdiv(n_slots, bn)
    span = bt * span_chunks(seq_len, bt, batch * blocks)
    grid = (batch, blocks, triton.cdiv(seq_len, span))
    constexprs = {"BT": bt, "BM": bm, "BN": bn}
    scalars = {"seq_len": "i32", "SPAN": "i32", "L": "i32", "M": "i32", "NS": "i32"}
    fwd = {"delta": triton_type(dtype), "slots": "i32", "docs": "i32", "states": "fp32", "read": "fp32"}
    bwd = {"d_read": "fp32", "slots": "i32", "docs": "i32", "d_states": "fp32", "d_delta": "fp32"}
    n_state = batch * n_slots * width

    def sums(values: str, reverse: bool) -> Launch:
        """The per-span sums of increments (forward) or of read gradients (reverse)."""
        pointers = {"values": values, "slots": "i32", "docs": "i32", "states": "fp32"}
        return Launch(
            _phasor_span_kernel,
            pointers,
            scalars,
            constexprs | {"REVERSE": reverse},
            grid,
            warps,
            stages,
            wide=frozenset({"values", "slots"}),
        )

    # the per-entry rows are indexed with int64 offsets (_level_rows' entry ids); documents and states are
    # [B, T] and [n_spans + 1, B, NS, M], with 64-bit slot offsets (_slot)
    return span, {
        "fwd_spans": sums(fwd["delta"], False),
        "fwd_pass": span_pass_launch(n_state, reverse=False, decay=False, wrap=True),
        "fwd": Launch(
            _phasor_fwd_kernel,
            fwd,
            scalars,
            constexprs,
            grid,
            warps,
            stages,
            wide=frozenset({"delta", "slots", "read"}),
        ),
        "bwd_spans": sums("fp32", True),
        "bwd_pass": span_pass_launch(n_state, reverse=True, decay=False, wrap=False),
        "bwd": Launch(
            _phasor_bwd_kernel,
            bwd,
            scalars,
            constexprs,
            grid,
            warps,
            stages,
            wide=frozenset({"d_read", "slots", "d_delta"}),
        ),
    }


def _pass_args(states: torch.Tensor, carry: torch.Tensor, seq_len: int, span: int) -> tuple:
    """Arguments of the span pass over ``states`` [n_spans + 1, B, NS, M] with the spans' ``carry``
    (kernels.span.span_carry; no decay: log_lam unused)."""
    return states, states, carry, states.shape[0] - 1, seq_len, span, states[0].numel(), 1, 1, states[0, 0].numel()


class PhasorScanTriton(torch.autograd.Function):
    """Triton forward and backward in spans (kernels/span.py); saves only the slot ids and the document
    numbers. ``reset`` (bool [B, T] or None) zeroes the phases before each document's first token."""

    @staticmethod
    def prepare_backward(ctx, delta, slots, n_slots, init, reset=None) -> tuple:
        """Save what the backward reads (int32 slot ids, document numbers, the spans' carry) without
        scanning; returns them with the span length and the launches."""
        batch, seq_len, levels, width = delta.shape
        slots = slots.to(torch.int32).contiguous()
        span, launches = phasor_launches(batch, seq_len, levels, width, n_slots, delta.dtype, device_capability(delta))
        docs = document_numbers(reset, batch, seq_len, delta.device)
        carry = span_carry(docs, span)
        ctx.save_for_backward(slots, docs, carry)
        ctx.meta = (n_slots, delta.dtype, init.dtype)
        ctx.set_materialize_grads(False)
        return slots, docs, carry, span, launches

    @staticmethod
    def forward(ctx, delta, slots, n_slots, init, reset=None):
        check_triton_inputs(delta, _phasor_fwd_kernel)
        seq_len, levels, width = delta.shape[1:]
        delta = delta.contiguous()
        slots, docs, carry, span, launches = PhasorScanTriton.prepare_backward(ctx, delta, slots, n_slots, init, reset)
        states = torch.empty(triton.cdiv(seq_len, span) + 1, *init.shape, dtype=torch.float32, device=delta.device)
        states[0] = init
        read = torch.empty(delta.shape, dtype=torch.float32, device=delta.device)
        sizes = (seq_len, span, levels, width, n_slots)
        launches["fwd_spans"].run(delta, slots, docs, states, *sizes)
        launches["fwd_pass"].run(*_pass_args(states, carry, seq_len, span))
        launches["fwd"].run(delta, slots, docs, states, read, *sizes)
        return read.to(delta.dtype), states[-1].clone()

    @staticmethod
    def backward(ctx, d_read, d_final):
        slots, docs, carry = ctx.saved_tensors
        n_slots, dtype, init_dtype = ctx.meta
        batch, seq_len, levels = slots.shape
        dev = slots.device
        width = d_read.shape[-1] if d_read is not None else d_final.shape[-1]
        g_read = torch.zeros(batch, seq_len, levels, width, device=dev) if d_read is None else d_read.float()
        g_read = g_read.contiguous()
        span, launches = phasor_launches(batch, seq_len, levels, width, n_slots, dtype, device_capability(slots))
        d_states = torch.zeros(triton.cdiv(seq_len, span) + 1, batch, n_slots, width, dtype=torch.float32, device=dev)
        if d_final is not None:
            d_states[-1] = d_final
        d_delta = torch.empty(batch, seq_len, levels, width, dtype=torch.float32, device=dev)
        sizes = (seq_len, span, levels, width, n_slots)
        launches["bwd_spans"].run(g_read, slots, docs, d_states, *sizes)
        launches["bwd_pass"].run(*_pass_args(d_states, carry, seq_len, span))
        launches["bwd"].run(g_read, slots, docs, d_states, d_delta, *sizes)
        return d_delta.to(dtype), None, None, d_states[0].to(init_dtype), None
