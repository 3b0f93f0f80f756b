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
def _state_block(log_lam, H, S, F, DV, BF: tl.constexpr, BD: tl.constexpr):
    """What a chunk state walk's program owns: (row, batch, head, feature offsets, value offsets, offsets
    and mask of its [BF, BD] block of G_s, mask of its normalisers (value block 0 carries them), log lam_s),
    row = (batch x head) * S + term. The blocks of one row are launched side by side, so they read its k
    and v (or q and dO) tiles from L2 after the first."""
    n_values = tl.cdiv(DV, BD)
    n_blocks = tl.cdiv(F, BF) * n_values
    pid = tl.program_id(0)
    blk = pid % n_blocks
    row, fb, vb = pid // n_blocks, blk // n_values, blk % n_values
    bh = row // S
    offs_f = fb * BF + tl.arange(0, BF)
    offs_d = vb * BD + tl.arange(0, BD)
    g_offs = offs_f[:, None] * DV + offs_d[None, :]
    g_mask = (offs_f < F)[:, None] & (offs_d < DV)[None, :]
    b_mask = (offs_f < F) & (vb == 0)
    ll = tl.load(log_lam + (bh % H) * S + row % S)
    return row, bh // H, bh % H, offs_f, offs_d, g_offs, g_mask, b_mask, ll


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
    NORMS_BY_PRODUCT: tl.constexpr,
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
    CPU tests run). A program owns a [BF, BD] block of the state (_state_block)."""
    row, b, h, offs_f, offs_d, g_offs, g_mask, b_mask, ll = _state_block(log_lam, H, S, F, DV, BF, BD)
    s = row % S
    rows = BH * S
    first = ((C0 // STRIDE) * rows + row).to(tl.int64) * W
    g = tl.load(states + first + g_offs, mask=g_mask, other=0.0)
    b_offs, b_store, bn = _normaliser_slot(states + first, F, DV, offs_f, b_mask, NORMS_BY_PRODUCT)
    if NORMS_BY_PRODUCT:  # a product with ones adds a chunk's rows
        ones = tl.full([BT, 16], 1.0, dtype=k.dtype.element_ty)
    pos = tl.arange(0, BT).to(tl.float32)
    n_chunks = tl.cdiv(seq_len, BT)
    end = tl.minimum(C0 + N, n_chunks)
    for first_c in range(C0, end, STRIDE):  # one span of chunks, then (BORDERS) the state leaving it
        for c in range(first_c, tl.minimum(first_c + STRIDE, end)):
            here = ((c - C0) * rows + row).to(tl.int64) * W
            tl.store(reads + here + g_offs, g.to(reads.dtype.element_ty), mask=g_mask)
            tl.store(reads + here + b_offs, bn.to(reads.dtype.element_ty), mask=b_store)
            start = c * BT
            base = token_base(b, h, start, seq_len, H)
            mask_t, n, _reads, writes, carry, _linked = chunk_masks(docs, b, start, seq_len, BT)
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
        if BORDERS:
            border = ((tl.cdiv(tl.minimum(first_c + STRIDE, end), STRIDE) * rows) + row).to(tl.int64) * W
            tl.store(states + border + g_offs, g, mask=g_mask)
            tl.store(states + border + b_offs, bn, mask=b_store)


@triton.jit
def chunk_output_kernel(
    q, k, v, coef, log_lam, docs, reads, out, z,
    seq_len, BH, S, C0, H: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, W: tl.constexpr,
    BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, GN: tl.constexpr, PRECISION: tl.constexpr,
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
    mask_t, _n, reads_in, _writes, _carry, linked = chunk_masks(docs, b, start, seq_len, BT)
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
