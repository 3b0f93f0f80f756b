"""Chunked PyTorch SOE scan: the CPU path, with a hand-written backward.

Layout. Work tensors are chunk-major, [N chunks, B*H, c, .], so that every per-chunk operand is
contiguous; fp32 (float64 for float64 inputs). The state is G [B*H, S*F, D] (the S terms stacked
along the contraction) and the normaliser b [B*H, S, F], kept apart from G: a ones column appended to
v would make every large product D + 1 = 65 columns wide, which the BLAS kernels run ~25% slower than 64.

Forward, per chunk of c tokens with entering per-term states G_s [F, D], b_s [F] (positions i, j in
the chunk; qd[i,s] = lam_s^(i+1), w[j,s] = lam_s^(c-1-j) coef[j,s]):
  o_i = sum_s qd[i,s] q_i^T G_s    + sum_{j<=i} (q_i . k_j) Wc[i, j] v_j
  z_i = sum_s qd[i,s] (q_i . b_s)  + sum_{j<=i} (q_i . k_j) Wc[i, j]
  G_s <- lam_s^c G_s + sum_j w[j,s] k_j v_j^T,    b_s <- lam_s^c b_s + sum_j w[j,s] k_j
with Wc[i, j] = sum_s coef[j,s] lam_s^(i-j). Every power has a non-negative exponent, so no factor
exceeds 1 and nothing is divided by a decay. The large cross-chunk terms are single matmuls with the S
terms folded into the contraction, [c, S*F] @ [S*F, D] (queries scaled by qd) and [S*F, c] @ [c, D]
(keys scaled by w), written into two work buffers reused by every chunk; the normaliser's are small
[c, F] @ [F, S] and [S, c] @ [c, F] products. Wc never exists as [S, c, c]: with E[s, d] = lam_s^d,
the product coef @ E is [c, c] indexed (j, i-j), and a fixed gather lays it out. The intra-chunk part
has no sequential dependency and runs for blocks of chunks at once.

Backward recomputes the states instead of storing them: one forward-order pass rebuilds (G, b) to get
the query gradients of the cross-chunk terms, and one reverse pass carries (dG, db) (seeded by the
gradient of the final state) for the key/value/coef gradients and the gradient of the initial state.
The decay gradient is sum over (reader, writer) pairs of (distance) x (contribution): within a chunk
it is computed locally; for pairs that cross chunk boundaries it is split into reader and writer
position sums (positions centred on the sequence middle; see docs/kernels.md for the precision).
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
        self.chunk = decay(c * log_lam).repeat(batch, 1)[:, :, None]  # lam^c: [BH, S, 1]


def _t(x: torch.Tensor) -> torch.Tensor:
    """[BH, r, X] -> contiguous [BH, X, r]. Broadcast elementwise products need unit stride along their
    last axis to vectorise; a transposed view as an operand makes them several times slower."""
    return x.transpose(1, 2).contiguous()


class _Scaled:
    """Work buffers for an operand scaled per term, [BH, c, S, F] and its transpose [BH, S, F, c], reused by
    every chunk (fresh multi-MB buffers per chunk would cost allocation and page faults)."""

    def __init__(self, like: torch.Tensor, n_terms: int) -> None:
        bh, c, feat = like.shape[1:]
        self.rows = like.new_empty(bh, c, n_terms, feat)
        self.cols = like.new_empty(bh, n_terms, feat, c)

    def rows_of(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """[BH, r, F] x [BH, r, S] -> [BH, r, S*F]: x_i scaled by scale[i, s] for every term s."""
        out = self.rows[:, : x.shape[1]]
        return torch.mul(scale[..., None], x[:, :, None, :], out=out).flatten(2)

    def cols_of(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The transpose of :meth:`rows_of`, [BH, S*F, r] (the left operand of state updates)."""
        out = self.cols[..., : x.shape[1]]
        return torch.mul(_t(scale)[:, :, None, :], _t(x)[:, None], out=out).flatten(1, 2)


def _advance(g, b, k, v, w, dec: _Decays, scaled: _Scaled) -> None:
    """In place, for one chunk: G [BH, S*F, D] <- lam^c G + sum_j w_j k_j v_j^T, b [BH, S, F] <- lam^c b + w^T K."""
    bh, n_terms, _ = b.shape
    g.view(bh, n_terms, -1).mul_(dec.chunk)
    g.baddbmm_(scaled.cols_of(k, w), v)
    b.mul_(dec.chunk).baddbmm_(w.transpose(1, 2), k)


def to_chunk_major(x: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, X] -> contiguous [N, B*H, c, X] in ``dtype``, zero-padding T up to N*c."""
    batch, seq_len, heads, width = x.shape
    pad = (-seq_len) % c
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
    x = x.view(batch, -1, c, heads, width).permute(1, 0, 3, 2, 4)
    return x.to(dtype).reshape(-1, batch * heads, c, width).contiguous()  # reshape is only a view when B = 1


def from_chunk_major(x: torch.Tensor, batch: int, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_chunk_major`: [N, B*H, c, X] -> contiguous [B, T, H, X] in ``dtype``."""
    n_chunks, bh, c, width = x.shape
    x = x.view(n_chunks, batch, bh // batch, c, width).permute(1, 0, 3, 2, 4)
    return x.reshape(batch, n_chunks * c, bh // batch, width)[:, :seq_len].to(dtype).contiguous()


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


def _intra_forward(q, k, v, coef, log_lam, out: torch.Tensor, z: torch.Tensor) -> None:
    """out <- (Q K^T * Wc) V and z <- its row sums, for a block of chunks."""
    intra = _Intra(q, k, coef, log_lam)
    weights = intra.a * intra.wc
    torch.bmm(weights.flatten(0, 1), v.flatten(0, 1), out=out.flatten(0, 1))
    torch.sum(weights, -1, out=z)


def _intra_backward(q, k, v, coef, log_lam, d_out, d_z, dq, dk, dv, dcoef) -> torch.Tensor:
    """dq, dk, dv, dcoef <- the gradients of the intra-chunk terms of a block of chunks; returns dlog_lam [H, S]."""
    n_chunks, bh, c, n_terms = coef.shape
    intra = _Intra(q, k, coef, log_lam)
    d_p = torch.baddbmm(d_z.flatten(0, 1)[..., None], d_out.flatten(0, 1), v.flatten(0, 1).transpose(-1, -2))
    d_p = d_p.view(n_chunks, bh, c, c)  # dL/dP for P = A * Wc (the upper triangle of Wc is zero)
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
    b0: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, ...]:
    """Forward on chunk-major tensors; returns (o [N, BH, c, D], z [N, BH, c], G_T [BH, S*F, D], b_T [BH, S, F])."""
    n_chunks, bh, c = q.shape[:3]
    chunks = _Chunks(log_lam, seq_len, c, bh // log_lam.shape[0])
    out = torch.empty_like(v)
    z = q.new_empty(n_chunks, bh, c)
    for blk in _blocks(n_chunks):
        _intra_forward(q[blk], k[blk], v[blk], coef[blk], log_lam, out[blk], z[blk])
    g, b = g0.clone(), b0.clone()
    scaled = _Scaled(q, b.shape[1])
    for n in range(n_chunks):
        r, dec = chunks.length(n), chunks.decays(n)
        q_n = q[n, :, :r]
        out[n, :, :r].baddbmm_(scaled.rows_of(q_n, dec.query), g)
        z[n, :, :r] += (torch.bmm(q_n, b.transpose(1, 2)) * dec.query).sum(-1)
        _advance(g, b, k[n, :, :r], v[n, :, :r], dec.key * coef[n, :, :r], dec, scaled)
    return out, z, g, b


def soe_backward_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    log_lam: torch.Tensor,
    g0: torch.Tensor,
    b0: torch.Tensor,
    d_out: torch.Tensor,
    d_z: torch.Tensor,
    d_gt: torch.Tensor,
    d_bt: torch.Tensor,
    seq_len: int,
    need_q: bool = True,
    need_log_lam: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv, dcoef, dlog_lam [H, S], dG0, db0) of <d_out, o> + <d_z, z> + <d_gt, G_T> +
    <d_bt, b_T>; same layouts as the forward.

    Without ``need_q`` and ``need_log_lam`` the forward-order pass is skipped (dq then holds only its
    intra-chunk part); without ``need_log_lam`` the decay-gradient sums are skipped (dlog_lam is 0).
    """
    n_chunks, bh, c, feat = q.shape
    heads, n_terms = log_lam.shape
    chunks = _Chunks(log_lam, seq_len, c, bh // heads)
    scaled = _Scaled(q, n_terms)

    # Intra-chunk part, block by block.
    dq, dk, dv, dcoef = (torch.empty_like(x) for x in (q, k, v, coef))
    d_log_lam = sum(
        _intra_backward(
            q[blk], k[blk], v[blk], coef[blk], log_lam, d_out[blk], d_z[blk], dq[blk], dk[blk], dv[blk], dcoef[blk]
        )
        for blk in _blocks(n_chunks)
    )

    # Cross-chunk part. Positions are centred so the reader and writer sums stay small.
    centre = (seq_len - 1) / 2.0
    reader = q.new_zeros(bh, n_terms)
    writer = q.new_zeros(bh, n_terms)
    g, b = g0.clone(), b0.clone()
    for n in range(n_chunks if need_q or need_log_lam else 0):
        r, dec = chunks.length(n), chunks.decays(n)
        q_n = q[n, :, :r]
        d_query = torch.bmm(g, d_out[n, :, :r].transpose(1, 2)).view(bh, n_terms, feat, r)
        d_query *= _t(dec.query)[:, :, None, :]
        d_norm = dec.query * d_z[n, :, :r, None]  # the normaliser read's weights: [BH, r, S]
        dq[n, :, :r] += d_query.sum(1).transpose(1, 2) + torch.bmm(d_norm, b)
        if need_log_lam:
            reads = (d_query * _t(q_n)[:, None]).sum(2)  # [BH, S, r]
            reads += (d_norm * torch.bmm(q_n, b.transpose(1, 2))).transpose(1, 2)
            reader += reads @ chunks.positions(n, centre, q)
        _advance(g, b, k[n, :, :r], v[n, :, :r], dec.key * coef[n, :, :r], dec, scaled)
    if need_log_lam:
        reader += (seq_len - 1 - centre) * ((g * d_gt).view(bh, n_terms, -1).sum(-1) + (b * d_bt).sum(-1))

    dg, db = d_gt.clone(), d_bt.clone()
    for n in reversed(range(n_chunks)):
        r, dec = chunks.length(n), chunks.decays(n)
        q_n, k_n, coef_n = q[n, :, :r], k[n, :, :r], coef[n, :, :r]
        w = dec.key * coef_n
        d_keys = torch.bmm(dg, v[n, :, :r].transpose(1, 2)).view(bh, n_terms, feat, r)
        dk[n, :, :r] += (d_keys * _t(w)[:, :, None, :]).sum(1).transpose(1, 2) + torch.bmm(w, db)
        d_w = (d_keys * _t(k_n)[:, None]).sum(2) + torch.bmm(db, k_n.transpose(1, 2))  # [BH, S, r]
        d_coef_state = d_w * dec.key.transpose(1, 2)
        dcoef[n, :, :r] += d_coef_state.transpose(1, 2)
        if need_log_lam:
            writer += (d_coef_state * coef_n.transpose(1, 2)) @ chunks.positions(n, centre, q)
        dv[n, :, :r] += torch.bmm(scaled.rows_of(k_n, w), dg)
        dg.view(bh, n_terms, -1).mul_(dec.chunk)
        dg.baddbmm_(scaled.cols_of(q_n, dec.query), d_out[n, :, :r])
        db.mul_(dec.chunk).baddbmm_((dec.query * d_z[n, :, :r, None]).transpose(1, 2), q_n)
    if not need_log_lam:
        return dq, dk, dv, dcoef, torch.zeros_like(log_lam), dg, db
    writer += (-1 - centre) * ((g0 * dg).view(bh, n_terms, -1).sum(-1) + (b0 * db).sum(-1))
    d_log_lam = d_log_lam + (reader - writer).view(-1, heads, n_terms).sum(0)
    return dq, dk, dv, dcoef, d_log_lam, dg, db


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 inputs are computed in float64 (for tight checks); everything else accumulates in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class SoeScanChunked(torch.autograd.Function):
    """Autograd wrapper: saves only the (re-laid-out) inputs; the backward recomputes the chunk states."""

    @staticmethod
    def forward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size):
        batch, seq_len, heads, feat = q.shape
        dt = work_dtype(q)
        qw, kw, vw, cw = (to_chunk_major(x, chunk_size, dt) for x in (q, k, v, coef))
        gw = g0.to(dt).reshape(batch * heads, -1, v.shape[-1])
        bw = b0.to(dt).reshape(batch * heads, -1, feat)
        ll = log_lam.to(dt)
        out, z, g_t, b_t = soe_forward_chunked(qw, kw, vw, cw, ll, gw, bw, seq_len)
        ctx.save_for_backward(qw, kw, vw, cw, ll, gw, bw)
        ctx.set_materialize_grads(False)
        ctx.meta = (batch, seq_len, [x.dtype for x in (q, k, v, coef, log_lam, g0, b0)], g0.shape, b0.shape)
        o = from_chunk_major(out, batch, seq_len, q.dtype)
        z = from_chunk_major(z[..., None], batch, seq_len, q.dtype)[..., 0]
        return o, z, g_t.view(g0.shape), b_t.view(b0.shape)

    @staticmethod
    def backward(ctx, d_o, d_z, d_g, d_b):
        qw, kw, vw, cw, ll, gw, bw = ctx.saved_tensors
        batch, seq_len, dtypes, g_shape, b_shape = ctx.meta
        chunk_size, dt = qw.shape[2], qw.dtype
        heads = qw.shape[1] // batch

        def chunked(grad: torch.Tensor | None, width: int) -> torch.Tensor:
            if grad is None:
                return qw.new_zeros(qw.shape[0], qw.shape[1], chunk_size, width)
            return to_chunk_major(grad.reshape(batch, seq_len, heads, width), chunk_size, dt)

        def state(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(like) if grad is None else grad.to(dt).reshape(like.shape)

        needs = ctx.needs_input_grad
        dq, dk, dv, dcoef, dll, dg0, db0 = soe_backward_chunked(
            qw, kw, vw, cw, ll, gw, bw,
            chunked(d_o, vw.shape[-1]), chunked(d_z, 1)[..., 0], state(d_g, gw), state(d_b, bw),
            seq_len, need_q=needs[0], need_log_lam=needs[4],
        )  # fmt: skip
        grads = (
            from_chunk_major(dq, batch, seq_len, dtypes[0]) if needs[0] else None,
            from_chunk_major(dk, batch, seq_len, dtypes[1]),
            from_chunk_major(dv, batch, seq_len, dtypes[2]),
            from_chunk_major(dcoef, batch, seq_len, dtypes[3]),
            dll.to(dtypes[4]) if needs[4] else None,
            dg0.view(g_shape).to(dtypes[5]),
            db0.view(b_shape).to(dtypes[6]),
        )
        return (*grads, None)
