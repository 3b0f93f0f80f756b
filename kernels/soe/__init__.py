"""The SOE scan: public entry point and backend dispatch."""

from __future__ import annotations

import math

import torch

from kernels._common import resolve_backend, use_ops, work_dtype
from kernels.soe.chunk import SoeScanChunked
from kernels.soe.naive import soe_scan_reference
from kernels.soe.op import soe_scan_op

State = tuple[torch.Tensor, torch.Tensor]

FAST_REACH = 64
"""Tokens over which a fast term decays below 2^-30 (`fast_term_count`): its state entering a chunk is then
made, to below the fp32 rounding of the state, by the tokens of the FAST_REACH before it alone."""


def fast_term_count(log_lam: torch.Tensor) -> int:
    """How many leading terms of the decays ``log_lam`` ([..., S], host values: a model's fixed decays at
    construction, never a tensor of a training step) have lam^FAST_REACH <= 2^-30 at every head: the
    ``fast_terms`` to give :func:`soe_scan` for them."""
    fast = (log_lam.detach().double().cpu() * FAST_REACH <= -30 * math.log(2)).reshape(-1, log_lam.shape[-1]).all(0)
    return int(fast.long().cumprod(0).sum())


def _check(q, k, v, coef, log_lam, initial_state, reset) -> None:
    batch, seq_len, heads, feat = q.shape
    if reset is not None and (reset.shape != (batch, seq_len) or reset.dtype != torch.bool):
        raise ValueError(f"reset must be bool [B, T] = {(batch, seq_len)}, got {reset.dtype} {tuple(reset.shape)}")
    n_terms = log_lam.shape[-1]
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != (batch, seq_len, heads):
        raise ValueError(f"v must be [B, T, H, D] matching q, got {tuple(v.shape)}")
    if coef.shape != (batch, seq_len, heads, n_terms):
        raise ValueError(f"coef must be [B, T, H, S] = {(batch, seq_len, heads, n_terms)}, got {tuple(coef.shape)}")
    if log_lam.shape != (heads, n_terms):
        raise ValueError(f"log_lam must be [H, S] = {(heads, n_terms)}, got {tuple(log_lam.shape)}")
    if initial_state is not None:
        g, b = initial_state
        if g.shape != (batch, heads, n_terms, feat, v.shape[-1]) or b.shape != (batch, heads, n_terms, feat):
            raise ValueError("initial_state must be (G [B, H, S, F, D], b [B, H, S, F])")


def soe_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    log_lam: torch.Tensor,
    initial_state: State | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
    reset: torch.Tensor | None = None,
    fast_terms: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, State | None]:
    """Multi-term decayed linear attention (VORT's SOE retention).

    Shapes: q, k [B, T, H, F]; v [B, T, H, D]; coef [B, T, H, S]; log_lam [H, S] (<= 0).
    Per term s: G_{t,s} = lam_s G_{t-1,s} + coef[t,s] k_t v_t^T and b_{t,s} = lam_s b_{t-1,s} + coef[t,s] k_t.
    Returns o [B, T, H, D] (o_t = sum_s q_t^T G_{t,s}), z [B, T, H] (z_t = sum_s q_t . b_{t,s}) and, if
    ``output_final_state``, the state (G [B, H, S, F, D], b [B, H, S, F]) in fp32 (float64 for
    float64 inputs); ``initial_state`` has the
    same structure. ``backend``: "reference" (sequential), "torch" (chunked, CPU default), "triton"
    (CUDA default, also runs under TRITON_INTERPRET=1) or "auto".
    ``reset`` (bool [B, T], optional): True where a token starts a document; the state is zeroed just
    before that token writes, so each document is scanned as if alone (every backend, forward and
    backward).
    ``fast_terms``: how many leading terms decay below 2^-30 within FAST_REACH tokens (`fast_term_count` of
    the decays; 0: none is taken as fast). The Triton backend may then walk those terms' states in pieces,
    each from zero a little before its first chunk, beside the slow terms' walks (it does where the walks
    of all terms would take more than one wave of the GPU); the other backends ignore it.
    """
    _check(q, k, v, coef, log_lam, initial_state, reset)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not 0 <= fast_terms < log_lam.shape[-1]:
        raise ValueError(f"fast_terms must be in [0, {log_lam.shape[-1]}) (some terms slow), got {fast_terms}")
    which = resolve_backend(backend, q)
    if which == "reference":
        return soe_scan_reference(q, k, v, coef, log_lam, initial_state, output_final_state, reset)
    if initial_state is None:
        batch, _, heads, feat = q.shape
        n_terms = log_lam.shape[-1]
        dtype = work_dtype(q.dtype)
        g0 = q.new_zeros(batch, heads, n_terms, feat, v.shape[-1], dtype=dtype)
        b0 = q.new_zeros(batch, heads, n_terms, feat, dtype=dtype)
    else:
        g0, b0 = initial_state
    args = (q, k, v, coef, log_lam, g0, b0, chunk_size, reset, fast_terms)
    if use_ops():  # the same Functions as a custom op: torch.compile keeps it in its graph (and see scans_as_ops)
        o, z, g_t, b_t, _states, _reads = soe_scan_op(*args, which)
    elif which == "triton":
        from kernels.soe.triton import SoeScanTriton

        o, z, g_t, b_t = SoeScanTriton.apply(*args)
    else:
        o, z, g_t, b_t = SoeScanChunked.apply(*args)
    return o, z, ((g_t, b_t) if output_final_state else None)
