"""Chunked PyTorch SOE scan: the CPU path, with a hand-written backward.

Layout. The normaliser b is the state G of an extra value column of ones, so v gets a ones column
(v' = [v, 1], width D' = D + 1) and o, z and (G, b) come out of one computation. Work is done in
[B*H, T, .] fp32 tensors.

Forward, per chunk of c tokens with entering per-term states G_s [F, D'] (positions i, j in the chunk):
  o'_i   = sum_s lam_s^(i+1) q_i^T G_s  +  sum_{j<=i} (q_i . k_j) Wc[i, j] v'_j
  G_s   <- lam_s^c G_s + sum_j lam_s^(c-1-j) coef[j,s] k_j v'_j^T
with Wc[i, j] = sum_s coef[j,s] lam_s^(i-j). Every power has a non-negative exponent, so no factor
exceeds 1 and nothing is divided by a decay. The cross-chunk terms are single matmuls with the S terms
folded into the contraction: [c, S*F] @ [S*F, D'] (queries scaled by lam^(i+1)) and
[S*F, c] @ [c, D'] (keys scaled by lam^(c-1-j) coef). Wc never exists as [S, c, c]: with
E[s, d] = lam_s^d, the product coef @ E is [c, c] indexed (j, i-j), and a fixed gather lays it out.
The intra-chunk part has no sequential dependency and runs for all chunks at once.

Backward recomputes the states instead of storing them: one forward-order pass rebuilds G to get the
query gradients of the cross-chunk term, and one reverse pass carries dG (seeded by the gradient of
the final state) for the key/value/coef gradients and the gradient of the initial state. The decay
gradient is sum over (reader, writer) pairs of (distance) x (contribution): within a chunk it is
computed locally; for pairs that cross chunk boundaries it is split into reader and writer position
sums (positions centred on the sequence middle; see docs/kernels.md for the precision this gives).
"""

from __future__ import annotations

import torch

State = tuple[torch.Tensor, torch.Tensor]


def decay(log_power: torch.Tensor) -> torch.Tensor:
    """exp(log_power) for log_power <= 0, with factors below ~1e-17 (fp32) / ~1e-130 (fp64) set to 0.

    Such factors are far below the working precision, and left in they make subnormal numbers in the
    products, which run tens of times slower on x86 CPUs.
    """
    cutoff = -40.0 if log_power.dtype != torch.float64 else -300.0
    return torch.exp(log_power).masked_fill(log_power < cutoff, 0.0)


class _Decays:
    """Decay tables for one chunk length c and log decays [H, S], repeated over the batch."""

    def __init__(self, log_lam: torch.Tensor, c: int, batch: int) -> None:
        pos = torch.arange(c, dtype=log_lam.dtype, device=log_lam.device)
        ll = log_lam[:, None, :]  # [H, 1, S]
        rep = (batch, 1, 1)
        self.query = decay((pos + 1)[None, :, None] * ll).repeat(rep)  # lam^(i+1): [BH, c, S]
        self.key = decay((c - 1 - pos)[None, :, None] * ll).repeat(rep)  # lam^(c-1-j)
        self.chunk = decay(c * log_lam).repeat(batch, 1)[:, :, None, None]  # lam^c: [BH, S, 1, 1]


def _scaled_t(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[BH, c, F] x [BH, c, S] -> contiguous [BH, S*F, c]: x_i scaled by scale[i, s] for every term s, transposed.

    This is the layout the state matmuls want as a contiguous operand.
    """
    return (scale.transpose(1, 2)[:, :, None, :] * x.transpose(1, 2)[:, None, :, :]).flatten(1, 2)


def _advance(g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coef: torch.Tensor, dec: _Decays) -> None:
    """In place: G [BH, S*F, D'] <- lam^c G + sum_j lam^(c-1-j) coef_j k_j v_j^T for one chunk."""
    bh, sf, width = g.shape
    n_terms = dec.chunk.shape[1]
    g.view(bh, n_terms, sf // n_terms, width).mul_(dec.chunk)
    g.baddbmm_(_scaled_t(k, dec.key * coef), v)


def _intra_index(c: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of the causal pairs (i >= j): in a [c, c] (i, j) matrix and in a [c, c] (j, i-j) one."""
    i, j = torch.tril_indices(c, c, device=device)
    return i * c + j, j * c + (i - j)


def _to_chunks(x: torch.Tensor, c: int) -> torch.Tensor:
    """[BH, T, X] -> [BH, N, c, X], zero-padding T up to a multiple of c."""
    pad = (-x.shape[1]) % c
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.unflatten(1, (-1, c))


def _chunk_spans(seq_len: int, c: int) -> list[tuple[int, int]]:
    return [(start, min(start + c, seq_len)) for start in range(0, seq_len, c)]


class _Intra:
    """The intra-chunk causal weights for all chunks at once: A = Q K^T, Wc, and the product P = A * Wc."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor, c: int):
        bh = coef.shape[0]
        heads = log_lam.shape[0]
        self.c = c
        self.qc, self.kc = _to_chunks(q, c), _to_chunks(k, c)  # [BH, N, c, F]
        self.coefc = _to_chunks(coef, c)  # [BH, N, c, S]
        dist = torch.arange(c, dtype=q.dtype, device=q.device)
        self.powers = decay(dist[None, None, :] * log_lam[:, :, None])  # E[h, s, d] = lam^d: [H, S, c]
        self.w_pos, self.p_pos = _intra_index(c, q.device)
        self.batch = bh // heads
        self.heads = heads
        by_head = self.coefc.unflatten(0, (self.batch, heads)).flatten(2, 3)  # [B, H, N*c, S]
        pc = torch.matmul(by_head, self.powers[None])  # [B, H, N*c (j), c (d)]
        pc = pc.reshape(bh, -1, c * c)
        wc = pc.new_zeros(pc.shape)
        wc[..., self.w_pos] = pc[..., self.p_pos]
        self.wc = wc.unflatten(-1, (c, c))  # [BH, N, c, c]
        self.a = self.qc @ self.kc.transpose(-1, -2)


def soe_forward_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    log_lam: torch.Tensor,
    g0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on [BH, T, .] fp32 tensors (v already has the ones column); returns (o' [BH, T, D'], G_T)."""
    bh, seq_len, feat = q.shape
    n_terms = coef.shape[-1]
    batch = bh // log_lam.shape[0]
    intra = _Intra(q, k, coef, log_lam, chunk_size)
    vc = _to_chunks(v, chunk_size)
    out = ((intra.a * intra.wc) @ vc).flatten(1, 2)[:, :seq_len].contiguous()
    g = g0.clone().view(bh, n_terms * feat, -1)
    decays: dict[int, _Decays] = {}
    for start, end in _chunk_spans(seq_len, chunk_size):
        c = end - start
        if c not in decays:
            decays[c] = _Decays(log_lam, c, batch)
        dec = decays[c]
        out[:, start:end].baddbmm_(_scaled_t(q[:, start:end], dec.query).transpose(1, 2), g)
        _advance(g, k[:, start:end], v[:, start:end], coef[:, start:end], dec)
    return out, g.view(g0.shape)


def soe_backward_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    log_lam: torch.Tensor,
    g0: torch.Tensor,
    d_out: torch.Tensor,
    d_gT: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv', dcoef, dlog_lam [H, S], dG0) of <d_out, o'> + <d_gT, G_T>; same layout as forward."""
    bh, seq_len, feat = q.shape
    heads, n_terms = log_lam.shape
    batch = bh // heads
    c0 = chunk_size
    intra = _Intra(q, k, coef, log_lam, c0)
    vc, doc = _to_chunks(v, c0), _to_chunks(d_out, c0)

    # Intra-chunk part, all chunks at once.
    d_p = doc @ vc.transpose(-1, -2)  # dL/dP, P = A * Wc (upper triangle of Wc is zero)
    dv = (intra.a * intra.wc).transpose(-1, -2) @ doc
    d_a = d_p * intra.wc
    dq = d_a @ intra.kc
    dk = d_a.transpose(-1, -2) @ intra.qc
    d_wc = (d_p * intra.a).flatten(-2)
    d_pc = d_wc.new_zeros(d_wc.shape)
    d_pc[..., intra.p_pos] = d_wc[..., intra.w_pos]
    d_pc = d_pc.view(batch, heads, -1, c0)  # [B, H, N*c (j), c (d)]
    dcoef = torch.matmul(d_pc, intra.powers.transpose(-1, -2)[None])  # [B, H, N*c, S]
    coef_by_head = intra.coefc.unflatten(0, (batch, heads)).flatten(2, 3)
    dist = torch.arange(c0, dtype=q.dtype, device=q.device)
    d_log_lam = ((coef_by_head.transpose(-1, -2) @ d_pc).sum(0) * dist * intra.powers).sum(-1)  # [H, S]
    dq, dk, dv = (x.flatten(1, 2)[:, :seq_len].contiguous() for x in (dq, dk, dv))
    dcoef = dcoef.flatten(0, 1)[:, :seq_len].contiguous()

    # Cross-chunk part. Positions are centred so the reader and writer sums stay small.
    centre = (seq_len - 1) / 2.0
    spans = _chunk_spans(seq_len, c0)
    decays: dict[int, _Decays] = {}
    reader = q.new_zeros(bh, n_terms)
    writer = q.new_zeros(bh, n_terms)
    g = g0.clone().view(bh, n_terms * feat, -1)
    for start, end in spans:
        c = end - start
        if c not in decays:
            decays[c] = _Decays(log_lam, c, batch)
        dec = decays[c]
        d_query = torch.bmm(g, d_out[:, start:end].transpose(1, 2)).view(bh, n_terms, feat, c)
        dq[:, start:end] += torch.einsum("bsfc,bcs->bcf", d_query, dec.query)
        pos = torch.arange(start, end, dtype=q.dtype, device=q.device) - centre
        reads = torch.einsum("bsfc,bcf->bcs", d_query, q[:, start:end]) * dec.query
        reader += torch.einsum("bcs,c->bs", reads, pos)
        _advance(g, k[:, start:end], v[:, start:end], coef[:, start:end], dec)
    reader += (seq_len - 1 - centre) * (g.view(d_gT.shape) * d_gT).sum((-1, -2))

    dg = d_gT.clone().view(bh, n_terms * feat, -1)
    for start, end in reversed(spans):
        c = end - start
        dec = decays[c]
        key_scale = dec.key * coef[:, start:end]
        d_keys = torch.bmm(dg, v[:, start:end].transpose(1, 2)).view(bh, n_terms, feat, c)
        dk[:, start:end] += torch.einsum("bsfc,bcs->bcf", d_keys, key_scale)
        d_coef_state = torch.einsum("bsfc,bcf->bcs", d_keys, k[:, start:end]) * dec.key
        dcoef[:, start:end] += d_coef_state
        pos = torch.arange(start, end, dtype=q.dtype, device=q.device) - centre
        writer += torch.einsum("bcs,c->bs", d_coef_state * coef[:, start:end], pos)
        dv[:, start:end] += torch.bmm(_scaled_t(k[:, start:end], key_scale).transpose(1, 2), dg)
        dg.view(bh, n_terms, feat, -1).mul_(dec.chunk)
        dg.baddbmm_(_scaled_t(q[:, start:end], dec.query), d_out[:, start:end])
    dg = dg.view(g0.shape)
    writer += (-1 - centre) * (g0 * dg).sum((-1, -2))
    d_log_lam = d_log_lam + (reader - writer).view(batch, heads, n_terms).sum(0)
    return dq, dk, dv, dcoef, d_log_lam, dg


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 inputs are computed in float64 (for tight checks); everything else accumulates in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def to_work_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, X] -> contiguous [B*H, T, X] in ``dtype``."""
    return x.transpose(1, 2).flatten(0, 1).to(dtype).contiguous()


def from_work_layout(x: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """[B*H, T, X] -> [B, T, H, X] in ``dtype``."""
    return x.unflatten(0, (batch, -1)).transpose(1, 2).to(dtype)


def join_state(g: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(G [B, H, S, F, D], b [B, H, S, F]) -> [B*H, S, F, D+1] in ``dtype``."""
    return torch.cat([g.to(dtype), b.to(dtype)[..., None]], dim=-1).flatten(0, 1)


def split_state(g: torch.Tensor, batch: int) -> State:
    """Inverse of :func:`join_state`."""
    g = g.unflatten(0, (batch, -1))
    return g[..., :-1], g[..., -1]


class SoeScanChunked(torch.autograd.Function):
    """Autograd wrapper: saves only the inputs; the backward recomputes the chunk states."""

    @staticmethod
    def forward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size):
        batch, dt = q.shape[0], work_dtype(q)
        qw, kw, cw = to_work_layout(q, dt), to_work_layout(k, dt), to_work_layout(coef, dt)
        vw = to_work_layout(torch.nn.functional.pad(v, (0, 1), value=1.0), dt)
        s0 = join_state(g0, b0, dt)
        ll = log_lam.to(dt)
        out, s_t = soe_forward_chunked(qw, kw, vw, cw, ll, s0, chunk_size)
        ctx.save_for_backward(qw, kw, vw, cw, ll, s0)
        ctx.set_materialize_grads(False)
        ctx.meta = (batch, chunk_size, [x.dtype for x in (q, k, v, coef, log_lam, g0, b0)])
        out = from_work_layout(out, batch, q.dtype)
        g_t, b_t = split_state(s_t, batch)
        return out[..., :-1].contiguous(), out[..., -1].contiguous(), g_t.contiguous(), b_t.contiguous()

    @staticmethod
    def backward(ctx, d_o, d_z, d_g, d_b):
        qw, kw, vw, cw, ll, s0 = ctx.saved_tensors
        batch, chunk_size, dtypes = ctx.meta
        bh, seq_len, _ = qw.shape
        d_out = qw.new_zeros(bh, seq_len, vw.shape[-1])
        if d_o is not None:
            d_out[..., :-1] = to_work_layout(d_o, qw.dtype)
        if d_z is not None:
            d_out[..., -1] = to_work_layout(d_z[..., None], qw.dtype)[..., 0]
        d_st = torch.zeros_like(s0)
        if d_g is not None:
            d_st[..., :-1] = d_g.flatten(0, 1)
        if d_b is not None:
            d_st[..., -1] = d_b.flatten(0, 1)
        dq, dk, dv, dcoef, dll, ds0 = soe_backward_chunked(qw, kw, vw, cw, ll, s0, d_out, d_st, chunk_size)
        dg0, db0 = split_state(ds0, batch)
        grads = (
            from_work_layout(dq, batch, dtypes[0]),
            from_work_layout(dk, batch, dtypes[1]),
            from_work_layout(dv[..., :-1], batch, dtypes[2]),
            from_work_layout(dcoef, batch, dtypes[3]),
            dll.to(dtypes[4]),
            dg0.to(dtypes[5]),
            db0.to(dtypes[6]),
        )
        return (*grads, None)
