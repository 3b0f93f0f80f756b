"""Triton kernels for the SOE scan (the CUDA path; also runs under TRITON_INTERPRET=1 on CPU tensors).

The same chunked algorithm as kernels/soe/chunk.py, forward and backward, with each SOE term's state
kept in registers by its own program and the terms' outputs summed by atomic adds. docs/kernels.md,
"SOE scan: the chunked algorithm", gives the formulas, the program layout and the precision rules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_triton_inputs


@triton.jit
def _term_tile(H, S, F, DV, BF: tl.constexpr, BD: tl.constexpr):
    """This program's batch, head, term and value block, and the offsets and mask of its state tile
    G_s [BF, BD] in a [B, H, S, F, DV] state."""
    pid = tl.program_id(0)
    i_d = tl.program_id(1)
    s = pid % S
    bh = pid // S
    h = bh % H
    b = bh // H
    offs_f = tl.arange(0, BF)
    offs_d = i_d * BD + tl.arange(0, BD)
    st_off = ((bh * S + s) * F + offs_f[:, None]) * DV + offs_d[None, :]
    st_mask = (offs_f < F)[:, None] & (offs_d < DV)[None, :]
    return b, h, s, i_d, offs_f, offs_d, st_off, st_mask


@triton.jit
def _chunk_decays(ll, start, seq_len, BT: tl.constexpr):
    """Positions and decay factors of the chunk starting at ``start`` (all exponents >= 0)."""
    offs_t = tl.arange(0, BT)
    pos = offs_t.to(tl.float32)
    mask_t = start + offs_t < seq_len
    n = tl.minimum(seq_len - start, BT).to(tl.float32)
    q_dec = tl.exp((pos + 1.0) * ll)
    k_dec = tl.where(mask_t, tl.exp(tl.maximum(n - 1.0 - pos, 0.0) * ll), 0.0)
    chunk_dec = tl.exp(n * ll)
    diff = pos[:, None] - pos[None, :]
    causal = diff >= 0
    intra = tl.where(causal, tl.exp(tl.where(causal, diff, 0.0) * ll), 0.0)
    return mask_t, q_dec, k_dec, chunk_dec, diff, intra


@triton.jit
def _load_chunk(
    q, k, v, coef, b, h, s, start, seq_len, H, S, F, DV, i_d, BT: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr
):
    """Rows of q, k [BT, BF], v' [BT, BD] and coef[:, s] [BT] of one chunk; masked entries are zero."""
    offs_t = start + tl.arange(0, BT)
    offs_f = tl.arange(0, BF)
    offs_d = i_d * BD + tl.arange(0, BD)
    mask_t = offs_t < seq_len
    row = ((b * seq_len + offs_t) * H + h).to(tl.int64)  # row * F overflows int32 at long B*T*H
    mask_qk = mask_t[:, None] & (offs_f < F)[None, :]
    mask_v = mask_t[:, None] & (offs_d < DV)[None, :]
    qc = tl.load(q + row[:, None] * F + offs_f[None, :], mask=mask_qk, other=0.0)
    kc = tl.load(k + row[:, None] * F + offs_f[None, :], mask=mask_qk, other=0.0)
    vc = tl.load(v + row[:, None] * DV + offs_d[None, :], mask=mask_v, other=0.0)
    cc = tl.load(coef + row * S + s, mask=mask_t, other=0.0).to(tl.float32)
    return row, mask_qk, mask_v, qc, kc, vc, cc


@triton.jit
def _soe_fwd_kernel(
    q,
    k,
    v,
    coef,
    log_lam,
    g0,
    out,
    g_t,
    seq_len,
    H,
    S,
    F,
    DV,
    BT: tl.constexpr,
    BF: tl.constexpr,
    BD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b, h, s, i_d, _offs_f, offs_d, st_off, st_mask = _term_tile(H, S, F, DV, BF, BD)
    state = tl.load(g0 + st_off, mask=st_mask, other=0.0)
    ll = tl.load(log_lam + h * S + s)
    for start in range(0, seq_len, BT):
        row, _mask_qk, mask_v, qc, kc, vc, cc = _load_chunk(
            q, k, v, coef, b, h, s, start, seq_len, H, S, F, DV, i_d, BT, BF, BD
        )
        _mask_t, q_dec, k_dec, chunk_dec, _diff, intra = _chunk_decays(ll, start, seq_len, BT)
        scores = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * (intra * cc[None, :])
        o = tl.dot(scores.to(vc.dtype), vc, input_precision=PRECISION)
        o += tl.dot((qc * q_dec[:, None]).to(vc.dtype), state.to(vc.dtype), input_precision=PRECISION)
        tl.atomic_add(out + row[:, None] * DV + offs_d[None, :], o, mask=mask_v)
        keys = kc * (k_dec * cc)[:, None]
        state = state * chunk_dec + tl.dot(tl.trans(keys.to(vc.dtype)), vc, input_precision=PRECISION)
    tl.store(g_t + st_off, state, mask=st_mask)


@triton.jit
def _soe_bwd_forward_order_kernel(
    q,
    k,
    v,
    coef,
    log_lam,
    g0,
    d_out,
    d_gt,
    dq,
    dk,
    dv,
    dcoef,
    dll,
    seq_len,
    centre,
    H,
    S,
    F,
    DV,
    BT: tl.constexpr,
    BF: tl.constexpr,
    BD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b, h, s, i_d, offs_f, offs_d, st_off, st_mask = _term_tile(H, S, F, DV, BF, BD)
    state = tl.load(g0 + st_off, mask=st_mask, other=0.0)
    ll = tl.load(log_lam + h * S + s)
    acc_ll = tl.zeros([BT], dtype=tl.float32)
    for start in range(0, seq_len, BT):
        row, mask_qk, mask_v, qc, kc, vc, cc = _load_chunk(
            q, k, v, coef, b, h, s, start, seq_len, H, S, F, DV, i_d, BT, BF, BD
        )
        mask_t, q_dec, k_dec, chunk_dec, diff, intra = _chunk_decays(ll, start, seq_len, BT)
        qf, kf, vf = qc.to(tl.float32), kc.to(tl.float32), vc.to(tl.float32)
        doc = tl.load(d_out + row[:, None] * DV + offs_d[None, :], mask=mask_v, other=0.0)
        # Cross-chunk reads: o'_i += lam^(i+1) q_i G.
        dq_inter = tl.dot(doc, tl.trans(state), input_precision=PRECISION) * q_dec[:, None]
        pos = (start + tl.arange(0, BT)).to(tl.float32) - centre
        acc_ll += tl.where(mask_t, tl.sum(dq_inter * qf, axis=1) * pos, 0.0)
        # Intra-chunk: P = (Q K^T) * W, W[i, j] = coef_j lam^(i-j).
        scores = tl.dot(qf, tl.trans(kf), input_precision=PRECISION)
        w = intra * cc[None, :]
        d_p = tl.dot(doc, tl.trans(vf), input_precision=PRECISION)
        d_a = d_p * w
        dq_c = dq_inter + tl.dot(d_a, kf, input_precision=PRECISION)
        dk_c = tl.dot(tl.trans(d_a), qf, input_precision=PRECISION)
        dv_c = tl.dot(tl.trans(scores * w), doc, input_precision=PRECISION)
        d_w = d_p * scores * intra
        acc_ll += tl.sum(d_w * cc[None, :] * diff, axis=1)
        tl.atomic_add(dq + row[:, None] * F + offs_f[None, :], dq_c, mask=mask_qk)
        tl.atomic_add(dk + row[:, None] * F + offs_f[None, :], dk_c, mask=mask_qk)
        tl.atomic_add(dv + row[:, None] * DV + offs_d[None, :], dv_c, mask=mask_v)
        tl.atomic_add(dcoef + row * S + s, tl.sum(d_w, axis=0), mask=mask_t)
        keys = kf * (k_dec * cc)[:, None]
        state = state * chunk_dec + tl.dot(tl.trans(keys), vf, input_precision=PRECISION)
    d_final = tl.load(d_gt + st_off, mask=st_mask, other=0.0)
    total = tl.sum(acc_ll, axis=0) + (seq_len - 1 - centre) * tl.sum(tl.sum(state * d_final, axis=1), axis=0)
    tl.atomic_add(dll + h * S + s, total)


@triton.jit
def _soe_bwd_reverse_order_kernel(
    q,
    k,
    v,
    coef,
    log_lam,
    g0,
    d_out,
    d_gt,
    dk,
    dv,
    dcoef,
    dll,
    dg0,
    seq_len,
    centre,
    H,
    S,
    F,
    DV,
    BT: tl.constexpr,
    BF: tl.constexpr,
    BD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b, h, s, i_d, offs_f, offs_d, st_off, st_mask = _term_tile(H, S, F, DV, BF, BD)
    d_state = tl.load(d_gt + st_off, mask=st_mask, other=0.0)
    ll = tl.load(log_lam + h * S + s)
    acc_ll = tl.zeros([BT], dtype=tl.float32)
    n_chunks = tl.cdiv(seq_len, BT)
    for rev in range(0, n_chunks):
        start = (n_chunks - 1 - rev) * BT
        row, mask_qk, mask_v, qc, kc, vc, cc = _load_chunk(
            q, k, v, coef, b, h, s, start, seq_len, H, S, F, DV, i_d, BT, BF, BD
        )
        mask_t, q_dec, k_dec, chunk_dec, _diff, _intra = _chunk_decays(ll, start, seq_len, BT)
        qf, kf, vf = qc.to(tl.float32), kc.to(tl.float32), vc.to(tl.float32)
        doc = tl.load(d_out + row[:, None] * DV + offs_d[None, :], mask=mask_v, other=0.0)
        key_scale = k_dec * cc
        d_keys = tl.dot(vf, tl.trans(d_state), input_precision=PRECISION)
        d_coef_state = tl.sum(d_keys * kf, axis=1) * k_dec
        pos = (start + tl.arange(0, BT)).to(tl.float32) - centre
        acc_ll += tl.where(mask_t, d_coef_state * cc * pos, 0.0)
        tl.atomic_add(dk + row[:, None] * F + offs_f[None, :], d_keys * key_scale[:, None], mask=mask_qk)
        tl.atomic_add(dcoef + row * S + s, d_coef_state, mask=mask_t)
        tl.atomic_add(
            dv + row[:, None] * DV + offs_d[None, :],
            tl.dot(kf * key_scale[:, None], d_state, input_precision=PRECISION),
            mask=mask_v,
        )
        d_state = d_state * chunk_dec + tl.dot(tl.trans(qf * q_dec[:, None]), doc, input_precision=PRECISION)
    tl.store(dg0 + st_off, d_state, mask=st_mask)
    init = tl.load(g0 + st_off, mask=st_mask, other=0.0)
    total = tl.sum(acc_ll, axis=0) + (-1.0 - centre) * tl.sum(tl.sum(init * d_state, axis=1), axis=0)
    tl.atomic_add(dll + h * S + s, -total)


def _precision(x: torch.Tensor) -> str:
    """tl.dot precision: full IEEE fp32 for fp32 inputs (TF32 would cost ~1e-3 relative error); 16-bit
    inputs are rounded already, so their fp32 intermediates may use TF32."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _blocks(chunk_size: int, feat: int, width: int) -> tuple[int, int, int]:
    """Block sizes: chunk and feature blocks are powers of two >= 16 (tl.dot's minimum); the chunk size only
    changes how work is split, not the result."""
    bt = max(16, triton.next_power_of_2(chunk_size))
    bf = max(16, triton.next_power_of_2(feat))
    bd = min(128, max(16, triton.next_power_of_2(width)))
    return bt, bf, bd


def fill_with_normaliser(out: torch.Tensor, main: torch.Tensor | None, last: torch.Tensor | None) -> torch.Tensor:
    """Write a gradient pair into the scans' "value plus normaliser column" layout: `main` into
    out[..., :-1] and `last` into out[..., -1]. A None gradient (output unused) leaves zeros."""
    if main is not None:
        out[..., :-1] = main
    if last is not None:
        out[..., -1] = last
    return out


class SoeScanTriton(torch.autograd.Function):
    """Triton forward and backward; saves only the inputs (states are recomputed in the backward)."""

    @staticmethod
    def forward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size):
        batch, seq_len, heads, feat = q.shape
        n_terms = log_lam.shape[-1]
        check_triton_inputs(q, _soe_fwd_kernel)
        q, k, coef = q.contiguous(), k.contiguous(), coef.contiguous()
        v1 = torch.nn.functional.pad(v, (0, 1), value=1.0).contiguous()
        width = v1.shape[-1]
        ll = log_lam.float().contiguous()
        s0 = torch.cat([g0.float(), b0.float()[..., None]], dim=-1).contiguous()
        out = torch.zeros(batch, seq_len, heads, width, dtype=torch.float32, device=q.device)
        s_t = torch.empty_like(s0)
        bt, bf, bd = _blocks(chunk_size, feat, width)
        grid = (batch * heads * n_terms, triton.cdiv(width, bd))
        prec = _precision(q)
        _soe_fwd_kernel[grid](
            q, k, v1, coef, ll, s0, out, s_t, seq_len, heads, n_terms, feat, width, bt, bf, bd, prec, num_warps=8
        )
        ctx.save_for_backward(q, k, v1, coef, ll, s0)
        ctx.set_materialize_grads(False)
        ctx.meta = (chunk_size, [x.dtype for x in (q, k, v, coef, log_lam, g0, b0)])
        out = out.to(q.dtype)
        return (
            out[..., :-1].contiguous(),
            out[..., -1].contiguous(),
            s_t[..., :-1].contiguous(),
            s_t[..., -1].contiguous(),
        )

    @staticmethod
    def backward(ctx, d_o, d_z, d_g, d_b):
        q, k, v1, coef, ll, s0 = ctx.saved_tensors
        chunk_size, dtypes = ctx.meta
        batch, seq_len, heads, feat = q.shape
        n_terms, width = ll.shape[-1], v1.shape[-1]
        d_out = torch.zeros(batch, seq_len, heads, width, dtype=torch.float32, device=q.device)
        fill_with_normaliser(d_out, d_o, d_z)
        d_st = fill_with_normaliser(torch.zeros_like(s0), d_g, d_b)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros_like(dq)
        dv = torch.zeros_like(d_out)
        dcoef = torch.zeros(coef.shape, dtype=torch.float32, device=q.device)
        dll = torch.zeros_like(ll)
        ds0 = torch.empty_like(s0)
        centre = (seq_len - 1) / 2.0
        bt, bf, bd = _blocks(chunk_size, feat, width)
        grid = (batch * heads * n_terms, triton.cdiv(width, bd))
        common = (heads, n_terms, feat, width, bt, bf, bd, _precision(q))
        _soe_bwd_forward_order_kernel[grid](
            q, k, v1, coef, ll, s0, d_out, d_st, dq, dk, dv, dcoef, dll, seq_len, centre, *common, num_warps=8
        )
        _soe_bwd_reverse_order_kernel[grid](
            q, k, v1, coef, ll, s0, d_out, d_st, dk, dv, dcoef, dll, ds0, seq_len, centre, *common, num_warps=8
        )
        grads = (
            dq.to(dtypes[0]),
            dk.to(dtypes[1]),
            dv[..., :-1].to(dtypes[2]),
            dcoef.to(dtypes[3]),
            dll.to(dtypes[4]),
            ds0[..., :-1].to(dtypes[5]),
            ds0[..., -1].to(dtypes[6]),
        )
        return (*grads, None)
