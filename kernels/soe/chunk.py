"""Chunked PyTorch SOE scan: the CPU path, with a hand-written backward.

Each chunk's contribution is a few matmuls with the S terms folded into the contraction, plus an
intra-chunk part computed for blocks of chunks at once; the backward recomputes the states (a
forward-order pass for the query gradients, a reverse pass for the rest). The algorithm, the layout
choices and the precision of the decay gradient are in docs/kernels.md ("SOE scan: the chunked
algorithm").
"""

from __future__ import annotations

import copy

import torch

from kernels._common import decay, document_numbers, work_dtype
from kernels.soe.contract import contract_terms


class _Decays:
    """Decay tables for one chunk length c and log decays [H, S], repeated over the batch. With resets
    (:meth:`_Chunks.decays`) a chunk's tables are masked copies, so the code using them is unchanged."""

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


class _Buffers:
    """Work buffers reused by every chunk: an operand scaled per term, [BH, c, S, F] and its transpose
    [BH, S, F, c], and a per-term gradient block [BH, S*F, c]. Fresh multi-MB temporaries per chunk cost
    allocation and page faults (docs/kernels.md)."""

    def __init__(self, like: torch.Tensor, c: int, n_terms: int) -> None:
        bh, feat = like.shape[0], like.shape[-1]
        self.rows = like.new_empty(bh, c, n_terms, feat)
        self.cols = like.new_empty(bh, n_terms, feat, c)
        self.block = like.new_empty(bh, n_terms * feat, c)

    def state_times(self, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """state [BH, S*F, X] times x^T ([BH, r, X]) -> [BH, S, F, r] (into the block buffer for whole chunks)."""
        bh, n_terms, feat, c = self.cols.shape
        r = x.shape[1]
        out = torch.bmm(state, x.transpose(1, 2), out=self.block if r == c else None)
        return out.view(bh, n_terms, feat, r)

    def rows_of(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """[BH, r, F] x [BH, r, S] -> [BH, r, S*F]: x_i scaled by scale[i, s] for every term s."""
        out = self.rows[:, : x.shape[1]]
        return torch.mul(scale[..., None], x[:, :, None, :], out=out).flatten(2)

    def cols_of(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The transpose of :meth:`rows_of`, [BH, S*F, r] (the left operand of state updates)."""
        out = self.cols[..., : x.shape[1]]
        return torch.mul(_t(scale)[:, :, None, :], _t(x)[:, None], out=out).flatten(1, 2)


def _advance(g, b, k, v, w, dec: _Decays, buffers: _Buffers) -> None:
    """In place, for one chunk: G [BH, S*F, D] <- lam^c G + sum_j w_j k_j v_j^T, b [BH, S, F] <- lam^c b + w^T K."""
    bh, n_terms, _ = b.shape
    g.view(bh, n_terms, -1).mul_(dec.chunk)
    g.baddbmm_(buffers.cols_of(k, w), v)
    b.mul_(dec.chunk).baddbmm_(w.transpose(1, 2), k)


def to_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, X] -> [B*H, T, X] in ``dtype``: a view when B = 1 (a head's rows are then H*X apart, which
    the matmuls take as their leading dimension), a copy otherwise."""
    batch, seq_len, heads, width = x.shape
    return x.to(dtype).permute(0, 2, 1, 3).reshape(batch * heads, seq_len, width)


def new_heads(batch: int, seq_len: int, heads: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [B*H, T, X] work tensor; for B = 1 a view of a contiguous [1, T, H, X] one, so that
    :func:`from_heads` needs no copy."""
    if batch == 1:
        return like.new_empty(1, seq_len, heads, width)[0].transpose(0, 1)
    return like.new_empty(batch * heads, seq_len, width)


def from_heads(x: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_heads`: [B*H, T, X] -> contiguous [B, T, H, X] in ``dtype``."""
    return x.unflatten(0, (batch, -1)).permute(0, 2, 1, 3).to(dtype).contiguous()


class _Chunks:
    """Chunk lengths and decay tables (cached per length) of a sequence of ``seq_len`` tokens; with
    document numbers ``docs`` [BH, T] (see :func:`document_numbers`), the tables of each chunk cut at
    its documents' borders."""

    def __init__(self, log_lam: torch.Tensor, seq_len: int, c: int, batch: int, docs: torch.Tensor | None) -> None:
        self.c, self.seq_len = c, seq_len
        self.count = -(-seq_len // c)
        self._tables: dict[int, _Decays] = {}
        self._args = (log_lam, batch)
        self.docs = docs

    def tokens(self, n: int) -> slice:
        return slice(n * self.c, min((n + 1) * self.c, self.seq_len))

    def decays(self, n: int) -> _Decays:
        r = min(self.c, self.seq_len - n * self.c)
        if r not in self._tables:
            self._tables[r] = _Decays(self._args[0], r, self._args[1])
        if self.docs is None:
            return self._tables[r]
        return self._cut(n, self._tables[r])

    def _cut(self, n: int, dec: _Decays) -> _Decays:
        """Chunk n's tables with resets: a token reads the entering state only if no reset is at or before it in
        the chunk (query), only tokens of the chunk's last document reach the leaving state (key), and the
        entering state reaches it only if the chunk has no reset (chunk)."""
        span = self.tokens(n)
        docs = self.docs[:, span]
        # the entering state belongs to the document of the token before the chunk (number 0 before the first)
        entering = self.docs[:, span.start - 1 : span.start] if span.start else torch.zeros_like(docs[:, :1])
        cut = copy.copy(dec)
        cut.query = dec.query * (docs == entering)[..., None]
        cut.key = dec.key * (docs == docs[:, -1:])[..., None]
        cut.chunk = dec.chunk * (docs[:, -1:] == entering)[..., None]
        return cut

    def take(self, n: int, *xs: torch.Tensor) -> list[torch.Tensor]:
        """Contiguous copies of chunk n of [BH, T, X] tensors: small, and the matmuls run faster on them
        than on the strided views."""
        span = self.tokens(n)
        return [x[:, span].contiguous() for x in xs]

    def positions(self, n: int, centre: float, like: torch.Tensor) -> torch.Tensor:
        """Token positions of chunk n minus ``centre``."""
        span = self.tokens(n)
        return torch.arange(span.start, span.stop, dtype=like.dtype, device=like.device) - centre

    def blocks(self) -> list[tuple[slice, int]]:
        """(tokens, chunk length) of the blocks of the intra-chunk part: up to INTRA_BLOCK whole chunks each,
        then the last, partial chunk on its own."""
        whole = self.seq_len // self.c
        step = INTRA_BLOCK * self.c
        blocks = [(slice(lo, min(lo + step, whole * self.c)), self.c) for lo in range(0, whole * self.c, step)]
        if self.seq_len % self.c:
            blocks.append((slice(whole * self.c, self.seq_len), self.seq_len % self.c))
        return blocks


INTRA_BLOCK = 16  # chunks per block of the intra-chunk part: keeps its [BH, block, c, c] tensors in cache


def head_document_numbers(reset: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """reset (bool [B, T]) -> :func:`document_numbers` [B*H, T, 1] in ``dtype``, per head row of the
    [B*H, T, X] layout."""
    batch, seq_len = reset.shape
    return document_numbers(reset, batch, seq_len, reset.device, dtype).repeat_interleave(heads, dim=0)[..., None]


def _in_chunks(x: torch.Tensor, tokens: slice, c: int) -> torch.Tensor:
    """[BH, T, X] -> the view [BH, n, c, X] of the whole chunks in ``tokens`` (inputs of the intra-chunk
    products are copied to contiguous blocks once: each would otherwise be copied by every product)."""
    return x[:, tokens].unflatten(1, (-1, c))


class _Intra:
    """Intra-chunk weights of a block of chunks: A = Q K^T and Wc, both [BH, n, c, c]; with the tokens'
    document numbers ``docs`` [BH, n, c, 1], Wc is zero between tokens of different documents."""

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor, docs: torch.Tensor | None
    ):
        bh, n_chunks, c = coef.shape[:3]
        heads = log_lam.shape[0]
        self.by_head = (bh // heads, heads, n_chunks, c)
        dist = torch.arange(c, dtype=q.dtype, device=q.device)
        self.dist = dist
        self.powers = decay(dist[None, None, :] * log_lam[:, :, None])[:, None]  # E[h, s, d] = lam^d: [H, 1, S, c]
        i, j = torch.tril_indices(c, c, device=q.device)
        self.w_pos, self.p_pos = i * c + j, j * c + (i - j)  # causal (i, j) in Wc; (j, i-j) in coef @ E
        pc = (coef.unflatten(0, self.by_head[:2]) @ self.powers).view(bh, n_chunks, c * c)
        wc = pc.new_zeros(pc.shape)
        wc[..., self.w_pos] = pc[..., self.p_pos]
        self.wc = wc.view(bh, n_chunks, c, c)
        self.same = None if docs is None else docs == docs.transpose(-1, -2)
        if self.same is not None:
            self.wc *= self.same
        self.a = q @ k.transpose(-1, -2)


def _intra_forward(q, k, v, coef, log_lam, docs, out: torch.Tensor, z: torch.Tensor) -> None:
    """out <- (Q K^T * Wc) V and z <- its row sums, for a block of chunks ([BH, n, c, X] views)."""
    intra = _Intra(q, k, coef, log_lam, docs)
    weights = intra.a * intra.wc
    out.copy_(weights @ v)
    z.copy_(weights.sum(-1, keepdim=True))


def _intra_backward(q, k, v, coef, log_lam, docs, d_out, d_z, dq, dk, dv, dcoef) -> torch.Tensor:
    """dq, dk, dv, dcoef <- the gradients of the intra-chunk terms of a block of chunks; returns dlog_lam [H, S]."""
    bh, n_chunks, c = coef.shape[:3]
    intra = _Intra(q, k, coef, log_lam, docs)
    d_p = d_out @ v.transpose(-1, -2) + d_z  # dL/dP for P = A * Wc (the upper triangle of Wc is zero)
    dv.copy_((intra.a * intra.wc).transpose(-1, -2) @ d_out)
    d_a = d_p * intra.wc
    dq.copy_(d_a @ k)
    dk.copy_(d_a.transpose(-1, -2) @ q)
    d_wc = d_p * intra.a if intra.same is None else d_p * intra.a * intra.same
    d_wc = d_wc.view(bh, n_chunks, c * c)
    d_pc = d_wc.new_zeros(d_wc.shape)
    d_pc[..., intra.p_pos] = d_wc[..., intra.w_pos]
    d_pc = d_pc.view(*intra.by_head, c)  # [B, H, n, c (j), c (d)]
    dcoef.copy_((d_pc @ intra.powers.transpose(-1, -2)).flatten(0, 1))
    coef_t = coef.unflatten(0, intra.by_head[:2]).transpose(-1, -2)
    return ((coef_t @ d_pc).sum((0, 2)) * intra.dist * intra.powers[:, 0]).sum(-1)


def soe_forward_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    log_lam: torch.Tensor,
    g0: torch.Tensor,
    b0: torch.Tensor,
    batch: int,
    c: int,
    docs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Forward on [B*H, T, X] tensors; returns (o [B*H, T, D], z [B*H, T, 1], G_T [BH, S*F, D], b_T [BH, S, F]).
    With document numbers ``docs`` [B*H, T, 1] (:func:`document_numbers`) the state restarts at each document."""
    seq_len = q.shape[1]
    heads = log_lam.shape[0]
    chunks = _Chunks(log_lam, seq_len, c, batch, None if docs is None else docs[..., 0])
    out = new_heads(batch, seq_len, heads, v.shape[-1], q)
    z = new_heads(batch, seq_len, heads, 1, q)
    for tokens, length in chunks.blocks():
        inputs = (_in_chunks(x, tokens, length).contiguous() for x in (q, k, v, coef))
        block_docs = None if docs is None else _in_chunks(docs, tokens, length)
        _intra_forward(*inputs, log_lam, block_docs, _in_chunks(out, tokens, length), _in_chunks(z, tokens, length))
    g, b = g0.clone(), b0.clone()
    buffers = _Buffers(q, c, b.shape[1])
    for n in range(chunks.count):
        span, dec = chunks.tokens(n), chunks.decays(n)
        q_n, k_n, v_n, coef_n = chunks.take(n, q, k, v, coef)
        out[:, span] += torch.bmm(buffers.rows_of(q_n, dec.query), g)
        z[:, span] += (torch.bmm(q_n, b.transpose(1, 2)) * dec.query).sum(-1, keepdim=True)
        _advance(g, b, k_n, v_n, dec.key * coef_n, dec, buffers)
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
    batch: int,
    c: int,
    need_q: bool = True,
    need_log_lam: bool = True,
    docs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients (dq, dk, dv, dcoef, dlog_lam [H, S], dG0, db0) of <d_out, o> + <d_z, z> + <d_gt, G_T> +
    <d_bt, b_T>; same layouts as the forward (d_z [B*H, T, 1]).

    Without ``need_q`` and ``need_log_lam`` the forward-order pass is skipped (dq then holds only its
    intra-chunk part); without ``need_log_lam`` the decay-gradient sums are skipped (dlog_lam is 0).
    """
    bh, seq_len = q.shape[:2]
    heads, n_terms = log_lam.shape
    chunks = _Chunks(log_lam, seq_len, c, batch, None if docs is None else docs[..., 0])
    buffers = _Buffers(q, c, n_terms)

    # Intra-chunk part, block by block.
    dq, dk, dv, dcoef = (new_heads(batch, seq_len, heads, x.shape[-1], q) for x in (q, k, v, coef))
    d_log_lam = sum(
        _intra_backward(
            *(_in_chunks(x, tokens, length).contiguous() for x in (q, k, v, coef)),
            log_lam,
            None if docs is None else _in_chunks(docs, tokens, length),
            *(_in_chunks(x, tokens, length).contiguous() for x in (d_out, d_z)),
            *(_in_chunks(x, tokens, length) for x in (dq, dk, dv, dcoef)),
        )
        for tokens, length in chunks.blocks()
    )

    # Cross-chunk part. Positions are centred so the reader and writer sums stay small.
    centre = (seq_len - 1) / 2.0
    reader = q.new_zeros(bh, n_terms)
    writer = q.new_zeros(bh, n_terms)
    g, b = g0.clone(), b0.clone()
    for n in range(chunks.count if need_q or need_log_lam else 0):
        span, dec = chunks.tokens(n), chunks.decays(n)
        q_n, k_n, v_n, coef_n, d_out_n = chunks.take(n, q, k, v, coef, d_out)
        d_query = buffers.state_times(g, d_out_n)  # per term, before the decay qd
        d_norm = dec.query * d_z[:, span]  # the normaliser read's weights: [BH, r, S]
        d_q_cross, reads = contract_terms(d_query, dec.query, q_n)
        dq[:, span] += d_q_cross + torch.bmm(d_norm, b)
        if need_log_lam:
            reads *= _t(dec.query)  # [BH, S, r]
            reads += (d_norm * torch.bmm(q_n, b.transpose(1, 2))).transpose(1, 2)
            reader += reads @ chunks.positions(n, centre, q)
        _advance(g, b, k_n, v_n, dec.key * coef_n, dec, buffers)
    if need_log_lam:
        reader += (seq_len - 1 - centre) * ((g * d_gt).view(bh, n_terms, -1).sum(-1) + (b * d_bt).sum(-1))

    dg, db = d_gt.clone(), d_bt.clone()
    for n in reversed(range(chunks.count)):
        span, dec = chunks.tokens(n), chunks.decays(n)
        q_n, k_n, v_n, coef_n, d_out_n = chunks.take(n, q, k, v, coef, d_out)
        w = dec.key * coef_n
        d_keys = buffers.state_times(dg, v_n)
        d_k_cross, d_w = contract_terms(d_keys, w, k_n)
        dk[:, span] += d_k_cross + torch.bmm(w, db)
        d_w += torch.bmm(db, k_n.transpose(1, 2))  # [BH, S, r]
        d_coef_state = d_w * dec.key.transpose(1, 2)
        dcoef[:, span] += d_coef_state.transpose(1, 2)
        if need_log_lam:
            writer += (d_coef_state * coef_n.transpose(1, 2)) @ chunks.positions(n, centre, q)
        dv[:, span] += torch.bmm(buffers.rows_of(k_n, w), dg)
        dg.view(bh, n_terms, -1).mul_(dec.chunk)
        dg.baddbmm_(buffers.cols_of(q_n, dec.query), d_out_n)
        db.mul_(dec.chunk).baddbmm_((dec.query * d_z[:, span]).transpose(1, 2), q_n)
    if not need_log_lam:
        return dq, dk, dv, dcoef, torch.zeros_like(log_lam), dg, db
    writer += (-1 - centre) * ((g0 * dg).view(bh, n_terms, -1).sum(-1) + (b0 * db).sum(-1))
    d_log_lam = d_log_lam + (reader - writer).view(-1, heads, n_terms).sum(0)
    return dq, dk, dv, dcoef, d_log_lam, dg, db


class SoeScanChunked(torch.autograd.Function):
    """Autograd wrapper: saves only the (re-laid-out) inputs; the backward recomputes the chunk states."""

    @staticmethod
    def prepare_backward(
        ctx, q, k, v, coef, log_lam, g0, b0, chunk_size, reset=None, fast_terms=0
    ) -> tuple[torch.Tensor, ...]:
        """Save what the backward reads (the inputs laid out per head, in the work dtype) without scanning:
        the forward's first half, and all a backward run apart from its forward needs (kernels/library.py)."""
        batch, _, heads, feat = q.shape
        dt = work_dtype(q.dtype)
        qw, kw, vw, cw = (to_heads(x, dt) for x in (q, k, v, coef))
        gw = g0.to(dt).reshape(batch * heads, -1, v.shape[-1])
        bw = b0.to(dt).reshape(batch * heads, -1, feat)
        ll = log_lam.to(dt)
        docs = None if reset is None else head_document_numbers(reset, heads, dt)
        ctx.save_for_backward(qw, kw, vw, cw, ll, gw, bw, docs)
        ctx.set_materialize_grads(False)
        ctx.meta = (batch, chunk_size, [x.dtype for x in (q, k, v, coef, log_lam, g0, b0)], g0.shape, b0.shape)
        return qw, kw, vw, cw, ll, gw, bw, docs

    @staticmethod
    def forward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size, reset=None, fast_terms=0):
        batch = q.shape[0]
        saved = SoeScanChunked.prepare_backward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size, reset)
        out, z, g_t, b_t = soe_forward_chunked(*saved[:7], batch, chunk_size, saved[7])
        o = from_heads(out, batch, q.dtype)
        z = from_heads(z, batch, q.dtype)[..., 0]
        return o, z, g_t.view(g0.shape), b_t.view(b0.shape)

    @staticmethod
    def backward(ctx, d_o, d_z, d_g, d_b):
        qw, kw, vw, cw, ll, gw, bw, docs = ctx.saved_tensors
        batch, chunk_size, dtypes, g_shape, b_shape = ctx.meta
        dt = qw.dtype

        def per_head(grad: torch.Tensor | None, width: int) -> torch.Tensor:
            if grad is None:
                return qw.new_zeros(qw.shape[0], qw.shape[1], width)
            return to_heads(grad.reshape(batch, qw.shape[1], -1, width), dt)

        def state(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(like) if grad is None else grad.to(dt).reshape(like.shape)

        needs = ctx.needs_input_grad
        dq, dk, dv, dcoef, dll, dg0, db0 = soe_backward_chunked(
            qw, kw, vw, cw, ll, gw, bw,
            per_head(d_o, vw.shape[-1]), per_head(d_z, 1), state(d_g, gw), state(d_b, bw),
            batch, chunk_size, need_q=needs[0], need_log_lam=needs[4], docs=docs,
        )  # fmt: skip
        grads = (
            from_heads(dq, batch, dtypes[0]) if needs[0] else None,
            from_heads(dk, batch, dtypes[1]),
            from_heads(dv, batch, dtypes[2]),
            from_heads(dcoef, batch, dtypes[3]),
            dll.to(dtypes[4]) if needs[4] else None,
            dg0.view(g_shape).to(dtypes[5]),
            db0.view(b_shape).to(dtypes[6]),
        )
        return (*grads, None, None, None)
