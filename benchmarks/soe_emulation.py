"""The SOE scan's Triton kernels (kernels/soe/gpu/forward.py, the value, key and query walks of
backward.py) emulated on CPU in their order of fp32 operations, with their rounding points, for the
precision table at lengths the interpreter cannot reach.

The interpreter runs a bf16 ``tl.dot`` as a plain fp32 matmul and takes hours at 512k tokens, so
benchmarks/scan_precision.py's SOE kernel rows come from here. What is emulated, for q, k, v, coef (and
the output gradients) in ``dtype`` (bf16 or fp32) at batch 1 and one head, without resets:

- the forward (``emulate_forward``): chunks of ``launches.forward_chunk`` tokens, each term's state walked
  over them (``chunk_states_kernel``) and read, rounded, by each chunk's outputs (``chunk_output_kernel``);
- the backward: chunks of 16 tokens (the launch table's chunk) in spans of ``launches.walk_span`` chunks
  (an H100's), all spans at once, the chunks of a span in turn; each span's own state gradient from zero
  (``state_grads_kernel``), the pass over the fp32 span-border states (``kernels.span``), then
  dv (``value_grads_kernel``), dk (``key_grads_kernel``'s feature walks), dcoef (the value
  walks' shares, the key launch's normalisers' share with the pairs, ``coef_grads_kernel``'s sum; all
  three for a zero final-state gradient) and dq (``query_grads_kernel``, from the forward's border
  states);
- the rounding to ``dtype`` of every ``tl.dot`` operand that the kernels cast: the state before a read
  (``read_state``), the per-term write rows, built in ``dtype`` from weights rounded to ``dtype``
  (``write_state``/``scaled_rows``; ``write_norms``), and the masked scores before their product with v
  (dv: with the output gradient; dq: the masked output-gradient scores before their product with k);
- the kernel matrix's fp32 product (decay table times coefficients), which the bf16 launches run as
  tf32: its operands truncated to tf32 (the tensor cores read the top 19 bits of an fp32 operand);
- the reads summed over the two term groups apart, in the kernels' order.

Not modelled: the order and rounding of the tensor cores' fp32 accumulation inside a product (torch's
fp32 matmul sums in its own order, with round-to-nearest), ``tl.exp``'s last-bit differences from torch's,
resets, the final state (the padding of a short last chunk changes only that), and the decays' gradient
(the launches with ``NEED_DLL``; VORT's decays are buffers). Outputs are returned before the store's
rounding to ``dtype``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.soe.gpu.launches import forward_chunk, term_groups, walk_span

CHUNK = 16  # tokens per chunk: the launch table's chunk on every target (launches.chunk_block)
CAPABILITY = 90  # the target whose span sizes are emulated: an H100


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` rounded to ``dtype`` (round to nearest even) and back: an operand the kernels cast."""
    return x if dtype == torch.float32 else x.to(dtype).float()


def _tf32(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` as a tf32 tensor-core operand (low 13 mantissa bits dropped) when the launch for
    ``dtype`` runs its fp32 products as tf32 (launches.precision: every dtype but fp32)."""
    return x if dtype == torch.float32 else (x.view(torch.int32) & -8192).view(torch.float32)


def _spans(x: torch.Tensor, n_spans: int, span: int, chunk: int = CHUNK) -> torch.Tensor:
    """[T, X] -> [n_spans, span, chunk, X], zero-padded past T (the kernels' masked loads give zeros)."""
    padded = x.new_zeros(n_spans * span * chunk, x.shape[-1])
    padded[: x.shape[0]] = x
    return padded.view(n_spans, span, chunk, x.shape[-1])


class _Decays:
    """The per-chunk decay factors of all terms for chunks of ``chunk`` tokens, fp32 as the kernels compute
    them: exp(d * log_lam)."""

    def __init__(self, log_lam: torch.Tensor, chunk: int = CHUNK) -> None:
        pos = torch.arange(chunk, dtype=torch.float32)[:, None]
        self.reads = torch.exp((pos + 1.0) * log_lam)  # [C, S]: lam^(i + 1), read_decays
        self.writes = torch.exp((chunk - 1.0 - pos) * log_lam)  # [C, S]: lam^(n - 1 - j), write_decays
        self.chunk = torch.exp(float(chunk) * log_lam)  # [S]: lam^n, chunk_decay
        self.table = torch.exp(pos * log_lam)  # [C, S]: lam^d, decay_table


def _write(g: torch.Tensor, x: torch.Tensor, y: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """One chunk's step of term-stacked states g [P, S, R, F]: g * decay (per term) plus (beta per term
    times y)^T @ x, for x [P, C, F], y [P, C, R], beta [P, C, S]: write_state, the rows built in ``dtype``
    from beta rounded to it (scaled_rows). With y all ones it is write_norms (beta rounded once)."""
    scaled = _to(_to(beta, dtype).transpose(1, 2)[:, :, None, :] * y.transpose(1, 2)[:, None], dtype)
    return g * decay[:, None, None] + scaled @ x[:, None]


def _read(state: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_s alpha[i, s] (state_s cast to dtype) @ x_i: read_state then over_terms, for state [P, S, R, F],
    x [P, C, F] and alpha [P, C, S]; [P, C, R]."""
    pt = _to(state, dtype) @ x.transpose(1, 2)[:, None]  # [P, S, R, C]
    return (pt * alpha.transpose(1, 2)[:, :, None, :]).sum(1).transpose(1, 2)


def _kernel_matrix(cc: torch.Tensor, dec: _Decays, dtype: torch.dtype) -> torch.Tensor:
    """Wc [P, C, C], Wc[i, j] = sum_s coef[j, s] lam_s^(i - j) for i >= j: kernel_matrix's product
    R = table @ coef^T (tf32 operands under bf16) and its gather R[i - j, j]."""
    r = _tf32(dec.table, dtype) @ _tf32(cc, dtype).transpose(1, 2)  # [P, d, j]
    i = torch.arange(dec.table.shape[0])
    dist = (i[:, None] - i[None, :]).clamp(min=0)
    return torch.where(i[:, None] >= i[None, :], r.gather(1, dist.expand(r.shape[0], -1, -1)), 0.0)


def _masked_scores(qc: torch.Tensor, kc: torch.Tensor, cc: torch.Tensor, dec: _Decays,
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """(q k^T) * Wc [P, C, C]."""
    return (qc @ kc.transpose(1, 2)) * _kernel_matrix(cc, dec, dtype)


class _Walk:
    """The operands of a scan cut into spans and chunks as the launch table cuts them, rounded to
    ``dtype``, with its decays, term groups and span decay."""

    def __init__(self, tensors: Sequence[torch.Tensor], log_lam: torch.Tensor, dtype: torch.dtype, feat: int,
                 width: int) -> None:  # fmt: skip
        seq_len = tensors[0].shape[0]
        self.seq_len, self.dtype = seq_len, dtype
        self.span = walk_span(1, seq_len, 1, log_lam.shape[-1], feat, width, CHUNK, CAPABILITY)
        n_chunks = -(-seq_len // CHUNK)
        self.n_spans = -(-n_chunks // self.span)
        self.parts = [_spans(_to(x.float(), dtype), self.n_spans, self.span) for x in tensors]
        self.log_lam = log_lam.float()
        self.dec = _Decays(self.log_lam)
        self.split = term_groups(log_lam.shape[-1])[0]  # the large group's terms first, the small group's after
        self.span_decay = torch.exp(float(self.span * CHUNK) * log_lam.float())
        self.reads = self.dec.reads.expand(self.n_spans, -1, -1)  # [P, C, S]

    def zeros(self, n_terms: int, rows: int, cols: int) -> torch.Tensor:
        return torch.zeros(self.n_spans, n_terms, rows, cols)

    def entering(self, own: torch.Tensor, reverse: bool) -> torch.Tensor:
        """The span pass (kernels.span) from a zero initial state (or final gradient, ``reverse``) over the
        spans' own states ``own`` [P, ...]: forward, the state entering each span; reverse, the gradient of
        the state leaving each span."""
        out = torch.zeros_like(own)
        decay = self.span_decay.view(-1, *([1] * (own.dim() - 2)))
        order = range(self.n_spans - 2, -1, -1) if reverse else range(1, self.n_spans)
        for p in order:
            q = p + 1 if reverse else p - 1
            out[p] = out[q] * decay + own[q]
        return out


def _chunk_states(k: torch.Tensor, v: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor, dtype: torch.dtype,
                  chunk: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The fp32 states entering each chunk of ``chunk`` tokens and after the last, G [n + 1, S, F, D] and
    b [n + 1, S, F], as chunk_states_kernel walks them from zero over k, v, coef [T, X] (exact in
    ``dtype``): per chunk the decay lam^chunk, then the write rows k_j lam^(chunk-1-j) coef_j made in
    ``dtype`` from the weights lam^(chunk-1-j) coef_j rounded to it, times v, and summed for the normalisers
    (a product with ones in the kernel on an H100, accumulated in fp32)."""
    n_chunks = -(-k.shape[0] // chunk)
    ks, vs, cs = (_spans(x, 1, n_chunks, chunk)[0] for x in (k, v, coef))
    dec = _Decays(log_lam, chunk)
    g = torch.zeros(n_chunks + 1, coef.shape[-1], k.shape[-1], v.shape[-1])
    bn = torch.zeros(n_chunks + 1, coef.shape[-1], k.shape[-1])
    for c in range(n_chunks):
        kw = _to(ks[c].T[None] * _to(dec.writes * cs[c], dtype).T[:, None, :], dtype)  # [S, F, C]
        g[c + 1] = g[c] * dec.chunk[:, None, None] + kw @ vs[c]
        bn[c + 1] = bn[c] * dec.chunk[:, None] + kw.sum(-1)
    return g, bn


def _border_states(w: _Walk, ks: torch.Tensor, vs: torch.Tensor, cs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's fp32 states entering each span, G [P, S, D, F] (transposed) and b [P, S, 1, F]: the
    forward's chunk walk (_chunk_states) at the span borders."""
    fc = forward_chunk(w.span, CHUNK, -(-w.seq_len // CHUNK))
    flat = (x.reshape(-1, x.shape[-1]) for x in (ks, vs, cs))
    g, bn = _chunk_states(*flat, w.log_lam, w.dtype, fc)
    stride = -(-w.span * CHUNK // fc)
    return g[::stride][: w.n_spans].transpose(-1, -2), bn[::stride][: w.n_spans, :, None]


def emulate_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """o [T, D] and z [T] of the Triton SOE forward on q, k [T, F], v [T, D], coef [T, S] (values exact in
    ``dtype``) and log_lam [S], from a zero initial state: fp32, as computed before the kernels store them
    in ``dtype`` (the caller rounds, so that the error of the walk and that of the store can be told
    apart). Chunks of ``launches.forward_chunk`` tokens; each term's fp32 state walked over them
    (chunk_states_kernel: the write rows k_j lam^(n-1-j) coef_j made in ``dtype`` from weights rounded to
    it, the normalisers' sum in fp32) and stored in ``dtype`` before each chunk; then chunk_output_kernel: the
    masked scores (rounded to ``dtype`` before their product with v) and, term by term in order, q times
    the rounded state, weighted by lam^(i+1) in fp32."""
    seq_len, n_terms = q.shape[0], log_lam.shape[-1]
    span = walk_span(1, seq_len, 1, n_terms, q.shape[-1], v.shape[-1], CHUNK, CAPABILITY)
    fc = forward_chunk(span, CHUNK, -(-seq_len // CHUNK))
    n_chunks = -(-seq_len // fc)
    qs, ks, vs, cs = (_to(x.float(), dtype) for x in (q, k, v, coef))
    g, bn = _chunk_states(ks, vs, cs, log_lam.float(), dtype, fc)
    qs, ks, vs, cs = (_spans(x, 1, n_chunks, fc)[0] for x in (qs, ks, vs, cs))
    dec = _Decays(log_lam.float(), fc)
    pm = _masked_scores(qs, ks, cs, dec, dtype)
    out, z = _to(pm, dtype) @ vs, pm.sum(-1)
    g_read, b_read = _to(g, dtype), _to(bn, dtype)
    for s in range(n_terms):
        out += (qs @ g_read[:n_chunks, s]) * dec.reads[None, :, s, None]
        z += (qs @ b_read[:n_chunks, s, :, None])[..., 0] * dec.reads[None, :, s]
    return out.reshape(-1, v.shape[-1])[:seq_len], z.reshape(-1)[:seq_len]


def emulate_value_grads(q: torch.Tensor, k: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor,
                        d_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """dv [T, D] of the Triton SOE backward for a zero final-state gradient (the inputs as for
    emulate_forward, d_out [T, D] exact in ``dtype``), fp32 before the store: each span's own state
    gradient walked in reverse from zero over the reads (span_states_kernel, REVERSE), the reverse span
    pass, then value_grads_kernel from the gradient of the state leaving each span, chunks in reverse:
    dv_j = (q_i . k_j) Wc[i, j] do_i summed over i (the scores rounded to ``dtype``) plus the large term
    group's reads of the state gradient by k, then the small group's."""
    w = _Walk((q, k, coef, d_out), log_lam, dtype, q.shape[-1], d_out.shape[-1])
    qs, ks, cs, dos = w.parts
    dec, split = w.dec, w.split
    dg = w.zeros(coef.shape[-1], d_out.shape[-1], q.shape[-1])
    for c in range(w.span - 1, -1, -1):
        dg = _write(dg, qs[:, c], dos[:, c], w.reads, dec.chunk, dtype)
    dg = w.entering(dg, True)
    dv = torch.empty(w.n_spans, w.span, CHUNK, d_out.shape[-1])
    for c in range(w.span - 1, -1, -1):
        qc, kc, cc, doc = qs[:, c], ks[:, c], cs[:, c], dos[:, c]
        pm = _masked_scores(qc, kc, cc, dec, dtype)
        alpha = dec.writes * cc
        dvc = _to(pm, dtype).transpose(1, 2) @ doc + _read(dg[:, :split], kc, alpha[..., :split], dtype)
        dv[:, c] = dvc + _read(dg[:, split:], kc, alpha[..., split:], dtype)
        dg = _write(dg, qc, doc, w.reads, dec.chunk, dtype)
    return dv.view(-1, d_out.shape[-1])[: w.seq_len]


def emulate_query_grads(k: torch.Tensor, v: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor,
                        d_out: torch.Tensor, d_z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """dq [T, F] of the Triton SOE backward (query_grads_kernel), fp32 before the store, for the inputs of
    emulate_forward (dq does not depend on q), d_out [T, D] exact in ``dtype`` and d_z [T] (fp32, as the
    kernels take it): from the forward's span-border states, chunks in order, the state held as
    [terms x features, values]:
    dq_i = sum_j ((do_i . v_j + dz_i) Wc[i, j], rounded to ``dtype``) k_j, then per term group (the small
    one first) sum_s lam_s^(i+1) (G_s cast to ``dtype`` do_i + dz_i b_s); the state then steps over the
    chunk's writes with rows (w_js k_j) built in ``dtype`` (so its rounding differs from the forward's)."""
    w = _Walk((k, v, coef, d_out), log_lam, dtype, k.shape[-1], v.shape[-1])
    ks, vs, cs, dos = w.parts
    dzs = _spans(d_z.float()[:, None], w.n_spans, w.span)[..., 0]
    g, bn = _border_states(w, ks, vs, cs)
    groups = (slice(w.split, None), slice(0, w.split))
    states = [[g[:, t].transpose(-1, -2), bn[:, t, 0]] for t in groups]  # [P, Sg, F, D], [P, Sg, F]
    dq = torch.empty(w.n_spans, w.span, CHUNK, k.shape[-1])
    for c in range(w.span):
        kc, vc, cc, doc, dzc = ks[:, c], vs[:, c], cs[:, c], dos[:, c], dzs[:, c]
        d_a = (doc @ vc.transpose(1, 2) + dzc[:, :, None]) * _kernel_matrix(cc, w.dec, dtype)
        dqc = _to(d_a, dtype) @ kc
        for t, held in zip(groups, states):
            fwd = _to(held[0], dtype) @ doc.transpose(1, 2)[:, None] + held[1][..., None] * dzc[:, None, None, :]
            dqc = dqc + (fwd * w.reads[..., t].transpose(1, 2)[:, :, None, :]).sum(1).transpose(1, 2)
            beta = _to(w.dec.writes[:, t] * cc[..., t], dtype)  # [P, C, Sg]
            scaled = _to(beta.transpose(1, 2)[:, :, None, :] * kc.transpose(1, 2)[:, None], dtype)  # [P, Sg, F, C]
            held[0] = held[0] * w.dec.chunk[t][:, None, None] + scaled @ vc[:, None]
            held[1] = held[1] * w.dec.chunk[t][:, None] + scaled.sum(-1)
        dq[:, c] = dqc
    return dq.view(-1, k.shape[-1])[: w.seq_len]


def _state_gradients(w: _Walk, qs: torch.Tensor, dos: torch.Tensor, dzs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gradients of the states leaving each span, dG [P, S, D, F] (transposed) and db [P, S, 1, F], for
    a zero final-state gradient: each span's own from zero over its reads, chunks in reverse
    (span_states_kernel, REVERSE: the normalisers' rows are (lam^(i+1) dz_i) rounded once, write_norms),
    then the reverse span pass."""
    n_terms, feat = w.dec.chunk.shape[-1], qs.shape[-1]
    dg, db = w.zeros(n_terms, dos.shape[-1], feat), w.zeros(n_terms, 1, feat)
    for c in range(w.span - 1, -1, -1):
        dg = _write(dg, qs[:, c], dos[:, c], w.reads, w.dec.chunk, w.dtype)
        rows = _to((w.reads * dzs[:, c, :, None]).transpose(1, 2), w.dtype)  # [P, S, C]
        db = db * w.dec.chunk[:, None, None] + rows[:, :, None, :] @ qs[:, c][:, None]
    return w.entering(dg, True), w.entering(db, True)


def emulate_key_grads(q: torch.Tensor, v: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor,
                      d_out: torch.Tensor, d_z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """dk [T, F] of the Triton SOE backward (key_grads_kernel's feature-block walks), fp32 before the store,
    for a zero final-state gradient (dk does not depend on k): from the gradients of the states leaving
    each span, chunks in reverse, the state gradient held as [terms x features, values]:
    dk_j = sum_i ((do_i . v_j + dz_i) Wc[i, j], rounded to ``dtype``) q_i, then per term group (the small
    one first) sum_s w_js (dG_s cast to ``dtype`` v_j + db_s); the state gradient then steps back over the
    chunk's reads with rows (lam^(i+1) q_i) built in ``dtype``."""
    w = _Walk((q, v, coef, d_out), log_lam, dtype, q.shape[-1], v.shape[-1])
    qs, vs, cs, dos = w.parts
    dzs = _spans(d_z.float()[:, None], w.n_spans, w.span)[..., 0]
    dg, db = _state_gradients(w, qs, dos, dzs)
    groups = (slice(w.split, None), slice(0, w.split))
    states = [[dg[:, t].transpose(-1, -2), db[:, t, 0]] for t in groups]  # [P, Sg, F, D], [P, Sg, F]
    dk = torch.empty(w.n_spans, w.span, CHUNK, q.shape[-1])
    for c in range(w.span - 1, -1, -1):
        qc, vc, cc, doc, dzc = qs[:, c], vs[:, c], cs[:, c], dos[:, c], dzs[:, c]
        d_a = (doc @ vc.transpose(1, 2) + dzc[:, :, None]) * _kernel_matrix(cc, w.dec, dtype)
        dkc = _to(d_a, dtype).transpose(1, 2) @ qc
        for t, held in zip(groups, states):
            back = _to(held[0], dtype) @ vc.transpose(1, 2)[:, None] + held[1][..., None]  # [P, Sg, F, C]
            alpha = w.dec.writes[:, t] * cc[..., t]  # [P, C, Sg]
            dkc = dkc + (back * alpha.transpose(1, 2)[:, :, None, :]).sum(1).transpose(1, 2)
            reads = _to(w.reads[..., t], dtype)
            scaled = _to(reads.transpose(1, 2)[:, :, None, :] * qc.transpose(1, 2)[:, None], dtype)  # [P, Sg, F, C]
            held[0] = held[0] * w.dec.chunk[t][:, None, None] + scaled @ doc[:, None]
            held[1] = held[1] * w.dec.chunk[t][:, None] + (scaled * dzc[:, None, None, :]).sum(-1)
        dk[:, c] = dkc
    return dk.view(-1, q.shape[-1])[: w.seq_len]


def emulate_coef_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor,
                       d_out: torch.Tensor, d_z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """dcoef [T, S] of the Triton SOE backward for decays without a gradient (VORT's launches), fp32 before
    the store, for a zero final-state gradient: the value walks' shares lam^(n-1-j) v_j . (dG_s cast to
    ``dtype``)^T k_j (one value block of all columns here), then the key launch's normalisers' share
    lam^(n-1-j) k_j . (db_s cast to ``dtype``) plus the pairs inside the chunk, sum over i >= j of
    (do_i . v_j + dz_i)(q_i . k_j) lam_s^(i-j) (its decay-table product in tf32 under bf16), added in the
    coefficient kernel's order; the state gradients step back over each chunk's reads."""
    w = _Walk((q, k, v, d_out), log_lam, dtype, q.shape[-1], v.shape[-1])
    qs, ks, vs, dos = w.parts
    dzs = _spans(d_z.float()[:, None], w.n_spans, w.span)[..., 0]
    dg, db = _state_gradients(w, qs, dos, dzs)
    i = torch.arange(CHUNK)
    rows = i[:, None] + i[None, :]  # [d, j]: the pair (j + d, j), by_distance
    dcoef = torch.empty(w.n_spans, w.span, CHUNK, coef.shape[-1])
    for c in range(w.span - 1, -1, -1):
        qc, kc, vc, doc, dzc = qs[:, c], ks[:, c], vs[:, c], dos[:, c], dzs[:, c]
        u = _to(dg, dtype) @ kc.transpose(1, 2)[:, None]  # [P, S, D, C]
        values = (u * vc.transpose(1, 2)[:, None]).sum(2).transpose(1, 2) * w.dec.writes  # [P, C, S]
        norms = (_to(db, dtype) @ kc.transpose(1, 2)[:, None])[:, :, 0].transpose(1, 2) * w.dec.writes
        d_p = doc @ vc.transpose(1, 2) + dzc[:, :, None]
        pairs = torch.where(i[:, None] >= i[None, :], d_p * (qc @ kc.transpose(1, 2)), 0.0)  # [P, i, j]
        by_distance = torch.where(rows < CHUNK, pairs.gather(1, rows.clamp(max=CHUNK - 1).expand(w.n_spans, -1, -1)),
                                  0.0)  # fmt: skip
        intra = _tf32(by_distance.transpose(1, 2), dtype) @ _tf32(w.dec.table, dtype)  # [P, j, S]
        dcoef[:, c] = values + (norms + intra)
        dg = _write(dg, qc, doc, w.reads, w.dec.chunk, dtype)
        step = _to((w.reads * dzc[:, :, None]).transpose(1, 2), dtype)  # [P, S, C]
        db = db * w.dec.chunk[:, None, None] + step[:, :, None, :] @ qc[:, None]
    return dcoef.view(-1, coef.shape[-1])[: w.seq_len]
