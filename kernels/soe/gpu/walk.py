"""Triton helpers of the SOE span kernels: programs that walk the chunks of a span in order (or in
reverse) with every term's state on chip.

A program owns one span of chunks of one batch x head and one column block of the state, and keeps
that block of all S terms' states in registers as one fp32 tile whose rows are (term, column) pairs,
term-major. Two layouts serve the four walks:

- by value block: [S * BC, F], row s * BC + c holding G_s[:, vb * BC + c]; the forward and the value
  gradient walk it;
- by feature block: [S * BC, D], row s * BC + c holding G_s[fb * BC + c, :]; the query and key gradient
  walk it, so that their sums over the value columns stay inside the program.

With the terms in the rows every write of the state is one tensor-core product accumulated into the
state, X += (B scaled per term)^T @ A ([S * BC, C] @ [C, R]), and every read is one product with the
state as the left operand, P^T = X @ A^T ([S * BC, R] @ [R, C]), followed by a weighted sum over the
terms of P's row groups. The state stays in the layout of a product's accumulator, which is also the
layout of a left operand: it never goes through shared memory (with the state as the right operand of
the reads, the compile gate found 30-60 KB of shared memory and spills).

Tile sizes must be powers of two, so the S terms are split in two groups of power-of-two sizes GA >= GB
(18 = 16 + 2, 5 = 4 + 1, 11 = 8 + 4 with one padded term, GB = 0 when S is a power of two): the padding
is at most one term where padding all of S to 32 would cost 14. A padded term has no decay and no
coefficient, so it stays zero.

The intra-chunk kernel matrix of all terms, Wc[i, j] = sum_s coef[j, s] lam_s^(i - j), is built once per
chunk without a per-term pass: R = E^T @ coef^T with the decay table E[s, d] = lam_s^d (S * C
exponentials, once per program) gives R[d, j] = sum_s lam_s^d coef[j, s], and a gather lays R out as
Wc[i, j] = R[i - j, j]. The backward's coefficient and decay gradients use the same table the other
way round.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.span import chunk_documents


@triton.jit
def span_program(BH, H, NB):
    """(span index, batch x head, batch, head, column block) of this program. The grid is one axis over
    span x batch x head x NB column blocks (2^31 - 1 programs reach far past 1M tokens), the column block
    fastest: the blocks of one span and head are launched side by side and walk the same chunks at the
    same time, so the q, k and coefficient tiles they all read come from L2 after the first."""
    pid = tl.program_id(0)
    blk = pid % NB
    rest = pid // NB
    p = rest // BH
    bh = rest % BH
    return p, bh, bh // H, bh % H, blk


@triton.jit
def in_first_block(mask, blk):
    """``mask``, false outside column block 0 (which alone handles the normalisers); built by a
    comparison over the mask's shape, which the interpreter also accepts."""
    return mask & ((tl.zeros(mask.shape, dtype=tl.int32) + blk) == 0)


@triton.jit
def span_chunk_count(p, seq_len, SPAN, BT: tl.constexpr):
    """Chunks of span ``p`` of ``SPAN`` chunks (the last span may be short)."""
    n_chunks = tl.cdiv(seq_len, BT)
    return tl.minimum(SPAN, n_chunks - p * SPAN)


@triton.jit
def token_base(b, h, start, seq_len, H):
    """Row of the chunk's first token in the [B*T*H, X] views (int64: it overflows int32 at batch 8 and
    512k tokens); token i of the chunk is row base + i * H."""
    return (b.to(tl.int64) * seq_len + start) * H + h


@triton.jit
def load_tile(ptr, base, H, width, cols, mask_t, BT: tl.constexpr):
    """[BT, len(cols)] of the chunk's rows at columns ``cols`` (< width), zero where masked."""
    rows = tl.arange(0, BT) * H
    mask = mask_t[:, None] & (cols < width)[None, :]
    return tl.load(ptr + base * width + (rows[:, None] * width + cols[None, :]), mask=mask, other=0.0)


@triton.jit
def store_tile(ptr, base, H, width, cols, mask_t, x, BT: tl.constexpr):
    """Store x [BT, len(cols)] at columns ``cols`` (< width) of the chunk's rows."""
    rows = tl.arange(0, BT) * H
    mask = mask_t[:, None] & (cols < width)[None, :]
    tl.store(ptr + base * width + (rows[:, None] * width + cols[None, :]), x, mask=mask)


@triton.jit
def chunk_masks(docs, b, start, seq_len, BT: tl.constexpr, RESETS: tl.constexpr):
    """The chunk's document masks (kernels.span.chunk_documents): tokens inside the sequence, its length
    n, ``reads`` (the token reads the entering state), ``writes`` (it reaches the leaving state),
    ``carry`` (1.0 when the entering state passes through the chunk, 0.0 when a reset cuts it) and
    ``linked`` [BT, BT] (i >= j and the same document). Without RESETS (a scan with no document starts)
    ``docs`` is not read: one document, and the three loads and the comparisons per chunk are gone."""
    offs = tl.arange(0, BT)
    mask_t = start + offs < seq_len
    n = tl.minimum(seq_len - start, BT)
    if RESETS:
        doc, entering, last = chunk_documents(docs, b, start, seq_len, BT)
        carry = (entering == last).to(tl.float32)
        linked = (offs[:, None] >= offs[None, :]) & (doc[:, None] == doc[None, :])
        reads, writes = doc == entering, mask_t & (doc == last)
    else:
        carry = 1.0
        linked = offs[:, None] >= offs[None, :]
        reads, writes = mask_t, mask_t
    return mask_t, n, reads, writes, carry, linked


@triton.jit
def group_decays(log_lam, h, S, g0, GS: tl.constexpr):
    """log lam [GS] of terms g0 .. g0 + GS - 1 (0 for padded terms, which have no coefficient)."""
    s = g0 + tl.arange(0, GS)
    return tl.load(log_lam + h * S + s, mask=s < S, other=0.0)


@triton.jit
def term_loads(log_lam, coef, base, h, H, S, g0, mask_t, GS: tl.constexpr, BT: tl.constexpr):
    """A group's decays log lam [GS] (0 for padded terms) and coefficients [BT, GS] (0 where padded or
    masked) for the terms g0 .. g0 + GS - 1."""
    cs = load_tile(coef, base, H, S, g0 + tl.arange(0, GS), mask_t, BT).to(tl.float32)
    return group_decays(log_lam, h, S, g0, GS), cs


@triton.jit
def read_decays(ll, reads, BT: tl.constexpr):
    """lam^(i + 1) [BT, GS]: how much of the state entering the chunk token i reads, zero where it does
    not (a reset at or before it in the chunk)."""
    pos = tl.arange(0, BT).to(tl.float32)
    return tl.where(reads[:, None], tl.exp((pos + 1.0)[:, None] * ll[None, :]), 0.0)


@triton.jit
def write_decays(ll, writes, n, BT: tl.constexpr):
    """lam^(n - 1 - j) [BT, GS]: how much of token j's write reaches the state leaving the chunk of n
    tokens, zero where it does not (a later reset in the chunk, or past the end)."""
    pos = tl.arange(0, BT).to(tl.float32)
    steps = tl.maximum(n.to(tl.float32) - 1.0 - pos, 0.0)
    return tl.where(writes[:, None], tl.exp(steps[:, None] * ll[None, :]), 0.0)


@triton.jit
def decay_table(log_lam, h, S, GN: tl.constexpr, BT: tl.constexpr):
    """E^T [BT, GN]: E^T[d, s] = lam_s^d for d < BT, zero for padded terms (all exponents <= 0)."""
    s = tl.arange(0, GN)
    d = tl.arange(0, BT).to(tl.float32)
    ll = tl.load(log_lam + h * S + s, mask=s < S, other=0.0)
    return tl.where((s < S)[None, :], tl.exp(d[:, None] * ll[None, :]), 0.0)


@triton.jit
def kernel_matrix(table, cs_all, linked, PRECISION: tl.constexpr, BT: tl.constexpr):
    """Wc [BT, BT], Wc[i, j] = sum_s coef[j, s] lam_s^(i - j) on ``linked`` pairs, zero elsewhere: one
    [BT, GN] @ [GN, BT] product R[d, j] = sum_s lam_s^d coef[j, s] and a gather R[i - j, j]."""
    r = tl.dot(table, tl.trans(cs_all), input_precision=PRECISION)
    offs = tl.arange(0, BT)
    dist = tl.maximum(offs[:, None] - offs[None, :], 0)
    return tl.where(linked, tl.gather(r, dist, 0), 0.0)


@triton.jit
def by_distance(x, BT: tl.constexpr):
    """T [BT, BT], T[d, j] = x[j + d, j] (0 past the chunk): x's entries regrouped by their distance
    i - j, for sums over pairs weighted by lam^(i - j)."""
    offs = tl.arange(0, BT)
    rows = offs[:, None] + offs[None, :]
    return tl.where(rows < BT, tl.gather(x, tl.minimum(rows, BT - 1), 0), 0.0)


@triton.jit
def scaled_rows(beta, y, BT: tl.constexpr, GS: tl.constexpr, BC: tl.constexpr):
    """[GS * BC, BT], row s * BC + c holding beta[:, s] * y[:, c] (beta [BT, GS], y [BT, BC]): a write's
    per-term operand, built in beta's dtype."""
    return tl.reshape(tl.trans(beta)[:, None, :] * tl.trans(y)[None, :, :], (GS * BC, BT))


@triton.jit
def write_state(x, a, beta, y, decay, BT: tl.constexpr, GS: tl.constexpr, BC: tl.constexpr,
                PRECISION: tl.constexpr):  # fmt: skip
    """A chunk's step of one term group's state tile x [GS * BC, R]: x * decay (per row) plus
    (beta per term times y)^T @ a, one [GS * BC, BT] @ [BT, R] product in a's dtype accumulated into the
    decayed state in place (the state is the product's accumulator, and the left operand of the reads:
    no copy through shared memory). The per-term scaling is done in a's dtype, to which the product
    rounds it for the tensor cores anyway."""
    scaled = scaled_rows(beta.to(a.dtype), y.to(a.dtype), BT, GS, BC)
    return tl.dot(scaled, a, acc=x * decay[:, None], input_precision=PRECISION)


@triton.jit
def read_state(x, a, PRECISION: tl.constexpr):
    """x @ a^T [GS * BC, BT]: a state tile x [GS * BC, R] read by the chunk's operand a [BT, R] (the state
    cast to a's dtype for the tensor cores, as flash-linear-attention does with its chunk states)."""
    return tl.dot(x.to(a.dtype), tl.trans(a), input_precision=PRECISION)


@triton.jit
def over_terms(pt, alpha, BT: tl.constexpr, GS: tl.constexpr, BC: tl.constexpr):
    """[BT, BC], out[i, c] = sum_s alpha[i, s] pt[s * BC + c, i]: a term-weighted read (pt from
    read_state, alpha [BT, GS])."""
    return tl.trans(tl.sum(tl.reshape(pt, (GS, BC, BT)) * tl.trans(alpha)[:, None, :], axis=0))


@triton.jit
def per_term(pt, y, BT: tl.constexpr, GS: tl.constexpr, BC: tl.constexpr):
    """[BT, GS], out[j, s] = sum_c pt[s * BC + c, j] y[j, c]: a read contracted with the chunk's rows
    y [BT, BC] over the block's columns, per term."""
    return tl.trans(tl.sum(tl.reshape(pt, (GS, BC, BT)) * tl.trans(y.to(tl.float32))[None, :, :], axis=1))


@triton.jit
def chunk_decay(ll, n, carry, GS: tl.constexpr, BC: tl.constexpr):
    """carry * lam^n per state row [GS * BC]: what of the state survives a chunk of n tokens."""
    d = carry * tl.exp(n.to(tl.float32) * ll)
    return tl.reshape(tl.broadcast_to(d[:, None], (GS, BC)), (GS * BC,))


@triton.jit
def state_tile(
    states, slot, bh, BH, S, F, DV, W, g0, blk, GS: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
    BY_VALUE: tl.constexpr,
):  # fmt: skip
    """Offsets and mask of one group's state tile in slot ``slot`` of a packed [slots, BH*S, W] buffer
    (W = F*DV + F: each term's G_s row-major, then b_s), as [GS * BC, BR]. BY_VALUE: row s * BC + c,
    column f = G_s[f, blk * BC + c] (BR >= F); otherwise row s * BC + c, column d = G_s[blk * BC + c, d]
    (BR >= DV). 64-bit offsets."""
    rows = tl.arange(0, GS * BC)
    s = g0 + rows // BC
    c = blk * BC + rows % BC
    r = tl.arange(0, BR)
    term = (((slot * BH + bh).to(tl.int64) * S) + s) * W
    if BY_VALUE:
        offs = term[:, None] + (r[None, :] * DV + c[:, None])
        mask = ((s < S) & (c < DV))[:, None] & (r < F)[None, :]
    else:
        offs = term[:, None] + (c[:, None] * DV + r[None, :])
        mask = ((s < S) & (c < F))[:, None] & (r < DV)[None, :]
    return offs, mask


@triton.jit
def norm_tile(states, slot, bh, BH, S, F, DV, W, GN: tl.constexpr, BF: tl.constexpr):
    """Offsets and mask of all terms' normalisers b_s as [GN, BF >= F] (row s, column f)."""
    s = tl.arange(0, GN)
    f = tl.arange(0, BF)
    term = (((slot * BH + bh).to(tl.int64) * S) + s) * W + F * DV
    return term[:, None] + f[None, :], (s < S)[:, None] & (f < F)[None, :]


@triton.jit
def norm_rows(states, slot, bh, BH, S, F, DV, W, g0, blk, GS: tl.constexpr, BC: tl.constexpr):
    """Offsets and mask of a group's normalisers as one column [GS * BC], row s * BC + c = b_s[blk * BC + c]."""
    rows = tl.arange(0, GS * BC)
    s = g0 + rows // BC
    f = blk * BC + rows % BC
    term = (((slot * BH + bh).to(tl.int64) * S) + s) * W + F * DV
    return term + f, (s < S) & (f < F)


@triton.jit
def write_norms(xn, a, beta, y_norm, decay, PRECISION: tl.constexpr):
    """The normalisers' step [GN, R]: xn * decay plus (beta * y_norm)^T @ a."""
    scaled = tl.trans(beta * y_norm[:, None]).to(a.dtype)
    return tl.dot(scaled, a, acc=xn * decay[:, None], input_precision=PRECISION)
