"""The SOE scan's Triton forward (kernels/soe/gpu/forward.py) emulated on CPU in its order of fp32
operations, with its rounding points, for the precision table at lengths the interpreter cannot reach.

The interpreter runs a bf16 ``tl.dot`` as a plain fp32 matmul and takes hours at 512k tokens, so
benchmarks/scan_precision.py's SOE kernel rows come from here. What is emulated, for q, k, v, coef in
``dtype`` (bf16 or fp32) at batch 1 and one head, without resets:

- chunks of 16 tokens (the launch table's chunk) in spans of ``launches.span_size`` chunks, all spans at
  once, the chunks of a span in turn; each span's own state from zero (``span_states_kernel``), the pass
  over the fp32 span-border states (``kernels.span``), then each span walked from its entering state for
  o (``output_kernel``) and z (``norm_output_kernel``);
- the rounding to ``dtype`` of every ``tl.dot`` operand that the kernels cast: the state before a read
  (``read_state``), the per-term write rows beta * v, built in ``dtype`` from beta rounded to ``dtype``
  (``write_state``/``scaled_rows``), the normalisers' write rows beta (``write_norms``), and the masked
  scores before their product with v;
- the kernel matrix's fp32 product (decay table times coefficients), which the bf16 launches run as
  tf32: its operands truncated to tf32 (the tensor cores read the top 19 bits of an fp32 operand);
- the reads summed over the small term group first, then the large one (the kernels' order).

Not modelled: the order and rounding of the tensor cores' fp32 accumulation inside a product (torch's
fp32 matmul sums in its own order, with round-to-nearest), ``tl.exp``'s last-bit differences from torch's,
resets, and the final state (the padding of a short last chunk changes only that). o and z are returned
before the store's rounding to ``dtype``.
"""

from __future__ import annotations

import torch

from kernels.soe.gpu.launches import span_size, term_groups

CHUNK = 16  # tokens per chunk: the launch table's chunk on every target (launches.chunk_block)


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` rounded to ``dtype`` (round to nearest even) and back: an operand the kernels cast."""
    return x if dtype == torch.float32 else x.to(dtype).float()


def _tf32(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` as a tf32 tensor-core operand (low 13 mantissa bits dropped) when the launch for
    ``dtype`` runs its fp32 products as tf32 (launches.precision: every dtype but fp32)."""
    return x if dtype == torch.float32 else (x.view(torch.int32) & -8192).view(torch.float32)


def _spans(x: torch.Tensor, n_spans: int, span: int) -> torch.Tensor:
    """[T, X] -> [n_spans, span, CHUNK, X], zero-padded past T (the kernels' masked loads give zeros)."""
    padded = x.new_zeros(n_spans * span * CHUNK, x.shape[-1])
    padded[: x.shape[0]] = x
    return padded.view(n_spans, span, CHUNK, x.shape[-1])


class _Decays:
    """The per-chunk decay factors of all terms, fp32 as the kernels compute them: exp(d * log_lam)."""

    def __init__(self, log_lam: torch.Tensor) -> None:
        pos = torch.arange(CHUNK, dtype=torch.float32)[:, None]
        self.reads = torch.exp((pos + 1.0) * log_lam)  # [C, S]: lam^(i + 1), read_decays
        self.writes = torch.exp((CHUNK - 1.0 - pos) * log_lam)  # [C, S]: lam^(n - 1 - j), write_decays
        self.chunk = torch.exp(float(CHUNK) * log_lam)  # [S]: lam^n, chunk_decay
        self.table = torch.exp(pos * log_lam)  # [C, S]: lam^d, decay_table


def _write(g: torch.Tensor, bn: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, cc: torch.Tensor,
           dec: _Decays, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One chunk's write into states g [P, S, D, F] (value-block layout: G_s transposed) and normalisers
    bn [P, S, F]: decayed, plus (beta per term times v)^T @ k with beta = lam^(n-1-j) coef_j; write_state
    and write_norms."""
    beta = _to(dec.writes * cc, dtype)  # [P, C, S]
    scaled = _to(beta.transpose(1, 2)[:, :, None, :] * vc.transpose(1, 2)[:, None, :, :], dtype)  # [P, S, D, C]
    g = g * dec.chunk[:, None, None] + scaled @ kc[:, None]
    bn = bn * dec.chunk[:, None] + beta.transpose(1, 2) @ kc
    return g, bn


def _read(state: torch.Tensor, qc: torch.Tensor, alpha: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_s alpha[i, s] (state_s cast to dtype) @ q_i: read_state then over_terms, for state [P, S, R, F]
    and alpha [P, C, S]; [P, C, R]."""
    pt = _to(state, dtype) @ qc.transpose(1, 2)[:, None]  # [P, S, R, C]
    return (pt * alpha.transpose(1, 2)[:, :, None, :]).sum(1).transpose(1, 2)


def _masked_scores(qc: torch.Tensor, kc: torch.Tensor, cc: torch.Tensor, dec: _Decays,
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """(q k^T) * Wc [P, C, C] with Wc[i, j] = sum_s coef[j, s] lam_s^(i - j) for i >= j: kernel_matrix's
    product R = table @ coef^T (tf32 operands under bf16) and its gather R[i - j, j]."""
    r = _tf32(dec.table, dtype) @ _tf32(cc, dtype).transpose(1, 2)  # [P, d, j]
    i = torch.arange(CHUNK)
    dist = (i[:, None] - i[None, :]).clamp(min=0)
    wc = torch.where(i[:, None] >= i[None, :], r.gather(1, dist.expand(r.shape[0], -1, -1)), 0.0)
    return (qc @ kc.transpose(1, 2)) * wc


def emulate_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coef: torch.Tensor, log_lam: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """o [T, D] and z [T] of the Triton SOE forward on q, k [T, F], v [T, D], coef [T, S] (values exact in
    ``dtype``) and log_lam [S], from a zero initial state: fp32, as computed before the kernels store them
    in ``dtype`` (the caller rounds, so that the error of the walk and that of the store can be told
    apart)."""
    seq_len, n_terms = coef.shape
    n_chunks = -(-seq_len // CHUNK)
    span = span_size(1, seq_len, 1, CHUNK)
    n_spans = -(-n_chunks // span)
    split = term_groups(n_terms)[0]  # the large group's terms come first, the small group's after
    qs, ks, vs, cs = (_spans(_to(x.float(), dtype), n_spans, span) for x in (q, k, v, coef))
    dec = _Decays(log_lam.float())
    g = torch.zeros(n_spans, n_terms, v.shape[-1], q.shape[-1])
    bn = torch.zeros(n_spans, n_terms, q.shape[-1])
    for c in range(span):  # each span's own state (span_states_kernel)
        g, bn = _write(g, bn, ks[:, c], vs[:, c], cs[:, c], dec, dtype)
    span_decay = torch.exp(float(span * CHUNK) * log_lam.float())
    g_in, bn_in = torch.zeros_like(g), torch.zeros_like(bn)
    for p in range(1, n_spans):  # the span pass: the fp32 state entering each span
        g_in[p] = g_in[p - 1] * span_decay[:, None, None] + g[p - 1]
        bn_in[p] = bn_in[p - 1] * span_decay[:, None] + bn[p - 1]
    g, bn = g_in, bn_in
    out = torch.empty(n_spans, span, CHUNK, v.shape[-1])
    z = torch.empty(n_spans, span, CHUNK)
    alpha = dec.reads.expand(n_spans, -1, -1)
    for c in range(span):  # output_kernel and norm_output_kernel
        qc, kc, vc, cc = qs[:, c], ks[:, c], vs[:, c], cs[:, c]
        pm = _masked_scores(qc, kc, cc, dec, dtype)
        o = _to(pm, dtype) @ vc
        o = o + _read(g[:, split:], qc, alpha[..., split:], dtype)
        out[:, c] = o + _read(g[:, :split], qc, alpha[..., :split], dtype)
        z[:, c] = pm.sum(-1) + _read(bn[:, :, None], qc, alpha, dtype)[..., 0]
        g, bn = _write(g, bn, kc, vc, cc, dec, dtype)
    return out.view(-1, v.shape[-1])[:seq_len], z.view(-1)[:seq_len]
