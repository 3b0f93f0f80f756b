"""The SOE scan's forward in chunk-parallel form: a walk that stores the state entering every chunk, then
one program per chunk for the outputs.

- ``chunk_states_kernel``: one program per batch x head x term x value block walks the chunks in order
  with that term's state block in registers ([F, BD] fp32: 32 registers a thread at 4 warps, so several
  programs share an SM) and stores the state entering each chunk, in the operands' dtype, for the output
  kernel (which reads it in that dtype anyway); at the backward's span borders, and at the end, it also
  stores the fp32 state that the backward starts its walks from and the caller returns.
- ``chunk_output_kernel``: one program per chunk x batch x head makes the chunk's o and z whole: the
  intra-chunk part through one kernel matrix for all terms (kernels/soe/gpu/walk.py), then, term by
  term, the read of the state entering the chunk, q @ G_s, weighted by lam_s^(i + 1).

Nothing is carried from chunk to chunk in the output kernel, so it runs as many programs as chunks x
heads, and its per-term work is a product and a [chunk, value] scaling: the benchmarks.predict launch
model prices the pair at 2.1 ms a layer of vort-125m at 16,384 tokens on an H100 against 7.4 ms for
span walks that carried every term's state through the outputs (docs/kernels.md, "Predicted GPU
times").
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.soe.gpu.walk import (
    chunk_masks,
    decay_table,
    group_decays,
    kernel_matrix,
    load_tile,
    norm_tile,
    read_decays,
    store_tile,
    term_loads,
    token_base,
)


@triton.jit
def _state_block(log_lam, BH, H, S, F, DV, BF: tl.constexpr, BD: tl.constexpr, FAST: tl.constexpr,
                 PARTS: tl.constexpr):  # fmt: skip
    """What a chunk state walk's program owns: (row, batch, head, part, parts, feature offsets, value
    offsets, offsets and mask of its [BF, BD] block of G_s, mask of its normalisers (value block 0 carries
    them), log lam_s), row = (batch x head) * S + term. The blocks of one row are launched side by side, so
    they read its k and v (or q and dO) tiles from L2 after the first.

    The first programs walk the slow terms (terms FAST.. of every batch x head) over the whole phase
    (part 0 of 1); then each fast term's walk (the first FAST terms, which decay below 2^-30 within
    FAST_REACH tokens) is cut into PARTS pieces of the phase, a program each (`_chunk_range`), so that the
    slow walks fill one wave and the short pieces fill the SMs around them."""
    n_values = tl.cdiv(DV, BD)
    n_blocks = tl.cdiv(F, BF) * n_values
    pid = tl.program_id(0)
    blk = pid % n_blocks
    r, fb, vb = pid // n_blocks, blk // n_values, blk % n_values
    if FAST == 0:
        row, part, parts = r, 0, 1
    else:
        n_slow = BH * (S - FAST)
        fast = r >= n_slow
        f = tl.maximum(r - n_slow, 0)
        row = tl.where(fast, f // PARTS // FAST * S + f // PARTS % FAST, r // (S - FAST) * S + FAST + r % (S - FAST))
        part = tl.where(fast, f % PARTS, 0)
        parts = tl.where(fast, PARTS, 1)
    bh = row // S
    offs_f = fb * BF + tl.arange(0, BF)
    offs_d = vb * BD + tl.arange(0, BD)
    g_offs = offs_f[:, None] * DV + offs_d[None, :]
    g_mask = (offs_f < F)[:, None] & (offs_d < DV)[None, :]
    b_mask = (offs_f < F) & (vb == 0)
    ll = tl.load(log_lam + (bh % H) * S + row % S)
    return row, bh // H, bh % H, part, parts, offs_f, offs_d, g_offs, g_mask, b_mask, ll


@triton.jit
def _chunk_range(part, parts, C0, end, FAST: tl.constexpr):
    """(first, end) of the chunks whose states piece ``part`` of ``parts`` of a walk over chunks C0 .. end - 1
    stores: equal pieces in order, the last one short; the whole walk (C0, end) without fast pieces."""
    lo, hi = C0, end
    if FAST != 0:
        per = tl.cdiv(end - C0, parts)
        lo = C0 + part * per
        hi = tl.minimum(lo + per, end)
    return lo, hi


@triton.jit
def _owned(mask, inside, FAST: tl.constexpr):
    """``mask`` where ``inside`` (a chunk of this program's piece, not of its warm-up); ``mask`` itself without
    fast pieces, so that those walks compile as they did before the pieces."""
    out = mask
    if FAST != 0:
        out = mask & inside
    return out


@triton.jit
def _normaliser_slot(slot, F, DV, offs_f, b_mask, NORMS_BY_PRODUCT: tl.constexpr):
    """(offsets, store mask, fp32 values) of a walk's normalisers (or their gradient) in the packed state
    row at ``slot``: with NORMS_BY_PRODUCT a [BF, 16] tile holding them in all 16 columns, for a product on
    the tensor cores, of which column 0 is stored; else a [BF] vector."""
    if NORMS_BY_PRODUCT:
        offs = F * DV + offs_f[:, None] + tl.zeros([1, 16], dtype=tl.int32)
        store = b_mask[:, None] & (tl.arange(0, 16) == 0)[None, :]
        values = tl.load(slot + offs, mask=b_mask[:, None], other=0.0)
    else:
        offs = F * DV + offs_f
        store = b_mask
        values = tl.load(slot + offs, mask=b_mask, other=0.0)
    return offs, store, values


@triton.jit
def chunk_states_kernel(
    k, v, coef, log_lam, docs, reads, states,
    seq_len, BH, S, STRIDE, C0, N, H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr, BORDERS: tl.constexpr,
    NORMS_BY_PRODUCT: tl.constexpr, FAST: tl.constexpr, PARTS: tl.constexpr, WARM: tl.constexpr,
    RESETS: tl.constexpr,
):  # fmt: skip
    """Term s's state block, value columns vb * BD.., walked over chunks C0 .. C0 + N - 1 (a phase; C0 a
    multiple of STRIDE) from the state entering chunk C0, slot C0 / STRIDE of ``states`` ([spans + 1,
    B*H*S, W] fp32, W = F*DV + F: G_s row-major, then b_s). Before each chunk c the state goes to slot
    c - C0 of ``reads`` ([phase chunks, B*H*S, W], the operands' dtype); with BORDERS, after every STRIDE
    chunks, and after the last, to the next slot of ``states``. A chunk of n tokens decays the state by
    lam^n (cut to zero when a document starts inside it) and adds sum_j lam^(n-1-j) coef_j k_j v_j^T over
    the tokens whose writes reach its end; the normalisers b_s ride with value block 0. The rows
    lam^(n-1-j) coef_j k_j are made in the operands' dtype from weights rounded to it, as the span walks'
    scaled_rows makes them (the tensor cores take them in that dtype anyway; made in fp32 and rounded after,
    the sm_90 walk took 194 instructions a chunk, against 175). NORMS_BY_PRODUCT adds the same rows for the
    normalisers by a product with ones on the tensor cores (the sum across the threads it replaces was a
    fifth of the walk's instructions on sm_90); else an fp32 sum of the unrounded rows (made from k in
    fp32: triton 3.8's interpreter widens a bf16 product to fp32 wrongly, and this path is the one the
    CPU tests run). A program owns a [BF, BD] block of the state (_state_block).

    A fast term's piece (FAST, PARTS: _state_block) stores the states entering its own chunks, walked from
    zero WARM chunks before its first (at least FAST_REACH tokens, over which the term decays below 2^-30:
    what it leaves out is below the fp32 rounding of the state), or from the phase's entering state when
    the piece starts the phase."""
    row, b, h, part, parts, offs_f, offs_d, g_offs, g_mask, b_mask, ll = _state_block(
        log_lam, BH, H, S, F, DV, BF, BD, FAST, PARTS
    )
    s = row % S
    rows = BH * S
    end = tl.minimum(C0 + N, tl.cdiv(seq_len, BT))
    lo, hi = _chunk_range(part, parts, C0, end, FAST)
    warm = C0
    if FAST != 0:  # a fast piece's walk starts WARM chunks early, from zero
        warm = tl.maximum(C0, lo - WARM)
    first = ((C0 // STRIDE) * rows + row).to(tl.int64) * W
    g = tl.load(states + first + g_offs, mask=_owned(g_mask, warm == C0, FAST), other=0.0)
    b_offs, b_store, bn = _normaliser_slot(states + first, F, DV, offs_f, b_mask, NORMS_BY_PRODUCT)
    if FAST != 0:
        bn = tl.where(warm == C0, bn, 0.0)
    if NORMS_BY_PRODUCT:  # a product with ones adds a chunk's rows
        ones = tl.full([BT, 16], 1.0, dtype=k.dtype.element_ty)
    pos = tl.arange(0, BT).to(tl.float32)
    for first_c in range(warm - (warm - C0) % STRIDE, hi, STRIDE):  # a span, then (BORDERS) the state leaving it
        from_c = first_c
        if FAST != 0:  # a piece's warm-up may start inside the span
            from_c = tl.maximum(first_c, warm)
        for c in range(from_c, tl.minimum(first_c + STRIDE, hi)):
            here = ((c - C0) * rows + row).to(tl.int64) * W
            tl.store(reads + here + g_offs, g.to(reads.dtype.element_ty), mask=_owned(g_mask, c >= lo, FAST))
            tl.store(reads + here + b_offs, bn.to(reads.dtype.element_ty), mask=_owned(b_store, c >= lo, FAST))
            start = c * BT
            base = token_base(b, h, start, seq_len, H)
            mask_t, n, _reads, writes, carry, _linked = chunk_masks(docs, b, start, seq_len, BT, RESETS)
            kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
            vc = load_tile(v, base, H, DV, offs_d, mask_t, BT)
            cs = tl.load(coef + (base + tl.arange(0, BT) * H) * S + s, mask=mask_t, other=0.0).to(tl.float32)
            steps = tl.maximum(n.to(tl.float32) - 1.0 - pos, 0.0)
            w = tl.where(writes, tl.exp(steps * ll) * cs, 0.0)
            kw = kc * w.to(kc.dtype)[:, None]
            decay = carry * tl.exp(n.to(tl.float32) * ll)
            rows_t = tl.trans(kw)
            g = tl.dot(rows_t, vc, acc=g * decay, input_precision=PRECISION)
            if NORMS_BY_PRODUCT:
                bn = tl.dot(rows_t, ones, acc=bn * decay, input_precision=PRECISION)
            else:
                bn = bn * decay + tl.sum(kc.to(tl.float32) * w[:, None], axis=0)
        if BORDERS:  # stored by the program whose piece holds the span's last chunk
            last = tl.minimum(first_c + STRIDE, end)
            border = ((tl.cdiv(last, STRIDE) * rows) + row).to(tl.int64) * W
            ours = (last > lo) & (last <= hi)
            tl.store(states + border + g_offs, g, mask=_owned(g_mask, ours, FAST))
            tl.store(states + border + b_offs, bn, mask=_owned(b_store, ours, FAST))


@triton.jit
def chunk_output_kernel(
    q, k, v, coef, log_lam, docs, reads, out, z,
    seq_len, BH, S, C0, H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
    RESETS: tl.constexpr,
):  # fmt: skip
    """o and z of one chunk c (C0 + program / BH) of one batch x head: sum_j (q_i . k_j) Wc[i, j] (v_j, 1)
    over the chunk's linked pairs, plus sum_s lam_s^(i+1) q_i (G_s, b_s) for the tokens that read the state
    entering the chunk (slot c - C0 of ``reads``). BD covers every value column. Stored once, in their
    dtype."""
    pid = tl.program_id(0)
    c, bh = C0 + pid // BH, pid % BH
    b, h = bh // H, bh % H
    start = c * BT
    offs_f = tl.arange(0, BF)
    offs_d = tl.arange(0, BD)
    base = token_base(b, h, start, seq_len, H)
    mask_t, _n, reads_in, _writes, _carry, linked = chunk_masks(docs, b, start, seq_len, BT, RESETS)
    qc = load_tile(q, base, H, F, offs_f, mask_t, BT)
    kc = load_tile(k, base, H, F, offs_f, mask_t, BT)
    vc = load_tile(v, base, H, DV, offs_d, mask_t, BT)
    _ll, cs = term_loads(log_lam, coef, base, h, H, S, 0, mask_t, GN, BT)
    pm = tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
    pm = pm * kernel_matrix(decay_table(log_lam, h, S, GN, BT), cs, linked, PRECISION, BT)
    o = tl.dot(pm.to(vc.dtype), vc, input_precision=PRECISION)
    zc = tl.sum(pm, axis=1)
    pos = tl.arange(0, BT).to(tl.float32) + 1.0
    g_offs = offs_f[:, None] * DV + offs_d[None, :]
    g_mask = (offs_f < F)[:, None] & (offs_d < DV)[None, :]
    for s in range(0, S):
        alpha = tl.where(reads_in, tl.exp(pos * tl.load(log_lam + h * S + s)), 0.0)
        here = (((c - C0) * BH + bh) * S + s).to(tl.int64) * W
        g = tl.load(reads + here + g_offs, mask=g_mask, other=0.0)
        o += tl.dot(qc, g.to(qc.dtype), input_precision=PRECISION) * alpha[:, None]
    n_offs, n_mask = norm_tile(reads, c - C0, bh, BH, S, F, DV, W, GN, BF)
    norms = tl.load(reads + n_offs, mask=n_mask, other=0.0).to(qc.dtype)  # b_s of every term, [GN, BF]
    q_norms = tl.dot(qc, tl.trans(norms), input_precision=PRECISION)  # [BT, GN]
    zc += tl.sum(q_norms * read_decays(group_decays(log_lam, h, S, 0, GN), reads_in, BT), axis=1)
    store_tile(out, base, H, DV, offs_d, mask_t, o, BT)
    tl.store(z + base + tl.arange(0, BT) * H, zc, mask=mask_t)
