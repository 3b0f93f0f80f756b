"""Chunked PyTorch SOE scan: the CPU path, with a hand-written backward.

Layout. The normaliser b is the state G of an extra value column of ones, so v gets a ones column
(v' = [v, 1], width D' = D + 1) and o, z and (G, b) come out of one computation. Work tensors are
chunk-major, [N chunks, B*H, c, .], so that every per-chunk operand is contiguous; fp32 (float64 for
float64 inputs).

Forward, per chunk of c tokens with entering per-term states G_s [F, D'] (positions i, j in the chunk):
  o'_i   = sum_s lam_s^(i+1) q_i^T G_s  +  sum_{j<=i} (q_i . k_j) Wc[i, j] v'_j
  G_s   <- lam_s^c G_s + sum_j lam_s^(c-1-j) coef[j,s] k_j v'_j^T
with Wc[i, j] = sum_s coef[j,s] lam_s^(i-j). Every power has a non-negative exponent, so no factor
exceeds 1 and nothing is divided by a decay. The cross-chunk terms are single matmuls with the S terms
folded into the contraction: [c, S*F] @ [S*F, D'] (queries scaled by lam^(i+1)) and
[S*F, c] @ [c, D'] (keys scaled by lam^(c-1-j) coef). Wc never exists as [S, c, c]: with
E[s, d] = lam_s^d, the product coef @ E is [c, c] indexed (j, i-j), and a fixed gather lays it out.
The intra-chunk part has no sequential dependency and runs for blocks of chunks at once.

Backward recomputes the states instead of storing them: one forward-order pass rebuilds G to get the
query gradients of the cross-chunk term, and one reverse pass carries dG (seeded by the gradient of
the final state) for the key/value/coef gradients and the gradient of the initial state. The decay
gradient is sum over (reader, writer) pairs of (distance) x (contribution): within a chunk it is
computed locally; for pairs that cross chunk boundaries it is split into reader and writer position
sums (positions centred on the sequence middle; see docs/kernels.md for the precision this gives).
"""

from __future__ import annotations

import torch

from kernels._common import fill_with_normaliser

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


def _scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[BH, c, F] x [BH, c, S] -> contiguous [BH, c, S*F]: x_i scaled by scale[i, s] for every term s."""
    return (scale[..., None] * x[:, :, None, :]).flatten(2)


def _scaled_t(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`_scaled`, made contiguous as [BH, S*F, c] (the left operand of state updates)."""
    return (scale.transpose(1, 2)[:, :, None, :] * x.transpose(1, 2)[:, None, :, :]).flatten(1, 2)


def _advance(g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coef: torch.Tensor, dec: _Decays) -> None:
    """In place: G [BH, S*F, D'] <- lam^c G + sum_j lam^(c-1-j) coef_j k_j v_j^T for one chunk."""
    bh, sf, width = g.shape
    n_terms = dec.chunk.shape[1]
    g.view(bh, n_terms, sf // n_terms, width).mul_(dec.chunk)
    g.baddbmm_(_scaled_t(k, dec.key * coef), v)


def to_chunk_major(x: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, X] -> contiguous [N, B*H, c, X] in ``dtype``, zero-padding T up to N*c."""
    batch, seq_len, heads, width = x.shape
    pad = (-seq_len) % c
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
    x = x.view(batch, -1, c, heads, width).permute(1, 0, 3, 2, 4)
    return x.to(dtype).reshape(-1, batch * heads, c, width)


def from_chunk_major(x: torch.Tensor, batch: int, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_chunk_major`: [N, B*H, c, X] -> [B, T, H, X] in ``dtype``."""
    n_chunks, bh, c, width = x.shape
    x = x.view(n_chunks, batch, bh // batch, c, width).permute(1, 0, 3, 2, 4)
    return x.reshape(batch, n_chunks * c, bh // batch, width)[:, :seq_len].to(dtype)


class _Chunks:
    """Chunk lengths and decay tables (cached per length) of a sequence of ``seq_len`` tokens."""

    def __init__(self, log_lam: torch.Tensor, seq_len: int, c: int, batch: int) -> None:
        self.c, self.seq_len = c, seq_len
        self.count = -(-seq_len // c)
        self._tables: dict[int, _Decays] = {}
        self._args = (log_lam, batch)

    def length(self, n: int) -> int:
        return min(self.c, self.seq_len - n * self.c)

    def decays(self, n: int) -> _Decays:
        r = self.length(n)
        if r not in self._tables:
            self._tables[r] = _Decays(self._args[0], r, self._args[1])
        return self._tables[r]

    def positions(self, n: int, centre: float, like: torch.Tensor) -> torch.Tensor:
        """Token positions of chunk n minus ``centre``."""
        start = n * self.c
        return torch.arange(start, start + self.length(n), dtype=like.dtype, device=like.device) - centre


INTRA_BLOCK = 16  # chunks per block of the intra-chunk part: keeps its [block, BH, c, c] tensors in cache


def _blocks(n_chunks: int) -> list[slice]:
    return [slice(lo, min(lo + INTRA_BLOCK, n_chunks)) for lo in range(0, n_chunks, INTRA_BLOCK)]


class _Intra:
    """Intra-chunk weights of a block of chunks: A = Q K^T and Wc, both [n, BH, c, c]."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor):
        n_chunks, bh, c, n_terms = coef.shape
        heads = log_lam.shape[0]
        self.by_head = (n_chunks, bh // heads, heads)
        dist = torch.arange(c, dtype=q.dtype, device=q.device)
        self.dist = dist
        self.powers = decay(dist[None, None, :] * log_lam[:, :, None])  # E[h, s, d] = lam^d: [H, S, c]
        i, j = torch.tril_indices(c, c, device=q.device)
        self.w_pos, self.p_pos = i * c + j, j * c + (i - j)  # causal (i, j) in Wc; (j, i-j) in coef @ E
        pc = (coef.view(*self.by_head, c, n_terms) @ self.powers).view(n_chunks, bh, c * c)
        wc = pc.new_zeros(pc.shape)
        wc[..., self.w_pos] = pc[..., self.p_pos]
        self.wc = wc.view(n_chunks, bh, c, c)
        self.a = q @ k.transpose(-1, -2)


def _intra_forward(q, k, v, coef, log_lam, out: torch.Tensor) -> None:
    """out <- (Q K^T * Wc) V' for a block of chunks."""
    intra = _Intra(q, k, coef, log_lam)
    torch.matmul(intra.a * intra.wc, v, out=out)


def _intra_backward(q, k, v, coef, log_lam, d_out, dq, dk, dv, dcoef) -> torch.Tensor:
    """dq, dk, dv', dcoef <- the gradients of the intra-chunk term of a block of chunks; returns dlog_lam [H, S]."""
    n_chunks, bh, c, n_terms = coef.shape
    intra = _Intra(q, k, coef, log_lam)
    d_p = d_out @ v.transpose(-1, -2)  # dL/dP for P = A * Wc (the upper triangle of Wc is zero)
    torch.matmul((intra.a * intra.wc).transpose(-1, -2), d_out, out=dv)
    d_a = d_p * intra.wc
    torch.matmul(d_a, k, out=dq)
    torch.matmul(d_a.transpose(-1, -2), q, out=dk)
    d_wc = (d_p * intra.a).view(n_chunks, bh, c * c)
    d_pc = d_wc.new_zeros(d_wc.shape)
    d_pc[..., intra.p_pos] = d_wc[..., intra.w_pos]
    d_pc = d_pc.view(*intra.by_head, c, c)  # [n, B, H, c (j), c (d)]
    torch.matmul(d_pc, intra.powers.transpose(-1, -2), out=dcoef.view(*intra.by_head, c, n_terms))
    coef_t = coef.view(*intra.by_head, c, n_terms).transpose(-1, -2)
    return ((coef_t @ d_pc).sum((0, 1)) * intra.dist * intra.powers).sum(-1)


def soe_forward_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    log_lam: torch.Tensor,
    g0: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward on chunk-major tensors (v has the ones column); returns (o' [N, BH, c, D'], G_T [BH, S, F, D'])."""
    n_chunks, bh, c, feat = q.shape
    n_terms = coef.shape[-1]
    chunks = _Chunks(log_lam, seq_len, c, bh // log_lam.shape[0])
    out = torch.empty_like(v)
    for b in _blocks(n_chunks):
        _intra_forward(q[b], k[b], v[b], coef[b], log_lam, out[b])
    g = g0.clone().view(bh, n_terms * feat, -1)
    for n in range(n_chunks):
        r, dec = chunks.length(n), chunks.decays(n)
        out[n, :, :r].baddbmm_(_scaled(q[n, :, :r], dec.query), g)
        _advance(g, k[n, :, :r], v[n, :, :r], coef[n, :, :r], dec)
    return out, g.view(g0.shape)


def soe_backward_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    log_lam: torch.Tensor,
    g0: torch.Tensor,
    d_out: torch.Tensor,
    d_gt: torch.Tensor,
    seq_len: int,
    need_q: bool = True,
    need_log_lam: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv', dcoef, dlog_lam [H, S], dG0) of <d_out, o'> + <d_gt, G_T>; same layout as forward.

    Without ``need_q`` and ``need_log_lam`` the forward-order pass is skipped (dq then holds only its
    intra-chunk part); without ``need_log_lam`` the decay-gradient sums are skipped (dlog_lam is 0).
    """
    n_chunks, bh, c, feat = q.shape
    heads, n_terms = log_lam.shape
    chunks = _Chunks(log_lam, seq_len, c, bh // heads)

    # Intra-chunk part, block by block.
    dq, dk, dv, dcoef = (torch.empty_like(x) for x in (q, k, v, coef))
    d_log_lam = sum(
        _intra_backward(q[b], k[b], v[b], coef[b], log_lam, d_out[b], dq[b], dk[b], dv[b], dcoef[b])
        for b in _blocks(n_chunks)
    )

    # Cross-chunk part. Positions are centred so the reader and writer sums stay small.
    centre = (seq_len - 1) / 2.0
    reader = q.new_zeros(bh, n_terms)
    writer = q.new_zeros(bh, n_terms)
    g = g0.clone().view(bh, n_terms * feat, -1)
    for n in range(n_chunks if need_q or need_log_lam else 0):
        r, dec = chunks.length(n), chunks.decays(n)
        q_n = q[n, :, :r]
        d_query = torch.bmm(g, d_out[n, :, :r].transpose(1, 2)).view(bh, n_terms, feat, r)
        d_query *= dec.query.transpose(1, 2)[:, :, None, :]
        dq[n, :, :r] += d_query.sum(1).transpose(1, 2)
        if need_log_lam:
            reads = (d_query * q_n.transpose(1, 2)[:, None]).sum(2)  # [BH, S, r]
            reader += reads @ chunks.positions(n, centre, q)
        _advance(g, k[n, :, :r], v[n, :, :r], coef[n, :, :r], dec)
    if need_log_lam:
        reader += (seq_len - 1 - centre) * (g.view(d_gt.shape) * d_gt).sum((-1, -2))

    dg = d_gt.clone().view(bh, n_terms * feat, -1)
    for n in reversed(range(n_chunks)):
        r, dec = chunks.length(n), chunks.decays(n)
        k_n, coef_n = k[n, :, :r], coef[n, :, :r]
        key_scale = dec.key * coef_n
        d_keys = torch.bmm(dg, v[n, :, :r].transpose(1, 2)).view(bh, n_terms, feat, r)
        dk[n, :, :r] += (d_keys * key_scale.transpose(1, 2)[:, :, None, :]).sum(1).transpose(1, 2)
        d_coef_state = (d_keys * k_n.transpose(1, 2)[:, None]).sum(2) * dec.key.transpose(1, 2)  # [BH, S, r]
        dcoef[n, :, :r] += d_coef_state.transpose(1, 2)
        if need_log_lam:
            writer += (d_coef_state * coef_n.transpose(1, 2)) @ chunks.positions(n, centre, q)
        dv[n, :, :r] += torch.bmm(_scaled(k_n, key_scale), dg)
        dg.view(bh, n_terms, feat, -1).mul_(dec.chunk)
        dg.baddbmm_(_scaled_t(q[n, :, :r], dec.query), d_out[n, :, :r])
    dg = dg.view(g0.shape)
    if not need_log_lam:
        return dq, dk, dv, dcoef, torch.zeros_like(log_lam), dg
    writer += (-1 - centre) * (g0 * dg).sum((-1, -2))
    d_log_lam = d_log_lam + (reader - writer).view(-1, heads, n_terms).sum(0)
    return dq, dk, dv, dcoef, d_log_lam, dg


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 inputs are computed in float64 (for tight checks); everything else accumulates in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def join_state(g: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(G [B, H, S, F, D], b [B, H, S, F]) -> [B*H, S, F, D+1] in ``dtype``."""
    return torch.cat([g.to(dtype), b.to(dtype)[..., None]], dim=-1).flatten(0, 1)


def split_state(g: torch.Tensor, batch: int) -> State:
    """Inverse of :func:`join_state`."""
    g = g.unflatten(0, (batch, -1))
    return g[..., :-1], g[..., -1]


class SoeScanChunked(torch.autograd.Function):
    """Autograd wrapper: saves only the (re-laid-out) inputs; the backward recomputes the chunk states."""

    @staticmethod
    def forward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size):
        batch, seq_len = q.shape[:2]
        dt = work_dtype(q)
        qw, kw, cw = (to_chunk_major(x, chunk_size, dt) for x in (q, k, coef))
        vw = to_chunk_major(torch.nn.functional.pad(v, (0, 1), value=1.0), chunk_size, dt)
        s0 = join_state(g0, b0, dt)
        ll = log_lam.to(dt)
        out, s_t = soe_forward_chunked(qw, kw, vw, cw, ll, s0, seq_len)
        ctx.save_for_backward(qw, kw, vw, cw, ll, s0)
        ctx.set_materialize_grads(False)
        ctx.meta = (batch, seq_len, [x.dtype for x in (q, k, v, coef, log_lam, g0, b0)])
        out = from_chunk_major(out, batch, seq_len, q.dtype)
        g_t, b_t = split_state(s_t, batch)
        return out[..., :-1].contiguous(), out[..., -1].contiguous(), g_t.contiguous(), b_t.contiguous()

    @staticmethod
    def backward(ctx, d_o, d_z, d_g, d_b):
        qw, kw, vw, cw, ll, s0 = ctx.saved_tensors
        batch, seq_len, dtypes = ctx.meta
        chunk_size = qw.shape[2]
        d_out = fill_with_normaliser(qw.new_zeros(batch, seq_len, qw.shape[1] // batch, vw.shape[-1]), d_o, d_z)
        d_st = fill_with_normaliser(
            torch.zeros_like(s0),
            None if d_g is None else d_g.flatten(0, 1),
            None if d_b is None else d_b.flatten(0, 1),
        )
        d_out = to_chunk_major(d_out, chunk_size, qw.dtype)
        needs = ctx.needs_input_grad
        dq, dk, dv, dcoef, dll, ds0 = soe_backward_chunked(
            qw, kw, vw, cw, ll, s0, d_out, d_st, seq_len, need_q=needs[0], need_log_lam=needs[4]
        )
        dg0, db0 = split_state(ds0, batch)
        grads = (
            from_chunk_major(dq, batch, seq_len, dtypes[0]) if needs[0] else None,
            from_chunk_major(dk, batch, seq_len, dtypes[1]),
            from_chunk_major(dv, batch, seq_len, dtypes[2])[..., :-1],
            from_chunk_major(dcoef, batch, seq_len, dtypes[3]),
            dll.to(dtypes[4]) if needs[4] else None,
            dg0.to(dtypes[5]),
            db0.to(dtypes[6]),
        )
        return (*grads, None)
