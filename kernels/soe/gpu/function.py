"""The SOE scan's Triton autograd Function: chunk states, the sequence pass, chunk-parallel outputs and
gradients (kernels/soe/gpu/launches.py lists the launches in the order they run)."""

from __future__ import annotations

import torch
import triton

from kernels._common import check_triton_inputs, device_capability, document_numbers
from kernels.soe.gpu.launches import soe_launches
from kernels.soe.gpu.output import output_kernel
from kernels.span import span_carry


def pack(g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(G [B, H, S, F, D], b [B, H, S, F]) -> one fp32 slot [B*H*S, F*D + F] of a packed state."""
    rows, feat = g.shape[0] * g.shape[1] * g.shape[2], g.shape[3]
    return torch.cat((g.float().reshape(rows, -1), b.float().reshape(rows, feat)), 1)


def unpack(slot: torch.Tensor, g_shape: torch.Size | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot [B*H*S, F*D + F] as (G, b) copies with G of shape ``g_shape``."""
    n = g_shape[-2] * g_shape[-1]
    return slot[:, :n].reshape(g_shape).clone(), slot[:, n:].reshape(g_shape[:4]).clone()


def slots(n_chunks: int, first: torch.Tensor, at_end: bool) -> torch.Tensor:
    """A packed fp32 buffer [n_chunks + 1, B*H*S, W] holding ``first`` in slot 0 (or, ``at_end``, in slot
    n_chunks); the chunk kernels write every other slot."""
    out = first.new_empty(n_chunks + 1, *first.shape)
    out[n_chunks if at_end else 0] = first
    return out


def pass_sizes(states: torch.Tensor, terms_per_row: int) -> tuple[int, int, int, int]:
    """The sequence pass's sizes for packed states [n + 1, B*H*S, W]: elements per slot, W, H*S, and
    elements per batch row."""
    width = states.shape[-1]
    return states[0].numel(), width, terms_per_row, terms_per_row * width


def entering_states(launches, k, v, coef, ll, docs, carry, initial, chunk, sizes) -> torch.Tensor:
    """The packed states entering every chunk (slot n_chunks: the final state), by the chunk-state
    kernel and the forward sequence pass."""
    seq_len, _bh, heads, n_terms = sizes[:4]
    n_chunks = triton.cdiv(seq_len, chunk)
    states = slots(n_chunks, initial, at_end=False)
    launches["fwd_states"].run(k, v, coef, coef, ll, docs, states, *sizes)
    launches["fwd_pass"].run(states, ll, carry, n_chunks, seq_len, chunk, *pass_sizes(states, heads * n_terms))
    return states


class SoeScanTriton(torch.autograd.Function):
    """Triton forward and backward in chunk form. Saves the inputs and the initial state; the backward
    recomputes the entering states (two light kernels) and derives the state gradients with the reverse
    sequence pass. ``reset`` (bool [B, T] or None) zeroes the state before each document's first token:
    the kernels get the document numbers, the pass a per-chunk carry (kernels/span.py). No atomics: every
    output element is stored by one program, partials over value blocks and chunks are summed by torch in
    a fixed order, so two runs give bitwise-equal results."""

    @staticmethod
    def forward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size, reset=None):
        batch, seq_len, heads, feat = q.shape
        n_terms, width = log_lam.shape[-1], v.shape[-1]
        check_triton_inputs(q, output_kernel)
        q, k, v = q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
        coef = coef.to(q.dtype).contiguous()
        ll = log_lam.float().contiguous()
        chunk, launches = soe_launches(
            batch, seq_len, heads, n_terms, feat, width, chunk_size, q.dtype, device_capability(q)
        )
        docs = document_numbers(reset, batch, seq_len, q.device)
        carry = span_carry(docs, chunk)
        initial = pack(g0, b0)
        sizes = (seq_len, batch * heads, heads, n_terms, feat, width, initial.shape[-1])
        states = entering_states(launches, k, v, coef, ll, docs, carry, initial, chunk, sizes)
        out = torch.empty(batch, seq_len, heads, width, dtype=torch.float32, device=q.device)
        z = torch.empty(batch, seq_len, heads, dtype=torch.float32, device=q.device)
        launches["fwd"].run(q, k, v, coef, ll, docs, states, out, z, *sizes)
        g_t, b_t = unpack(states[-1], g0.shape)
        ctx.save_for_backward(q, k, v, coef, ll, initial, docs, carry)
        ctx.set_materialize_grads(False)
        ctx.meta = (chunk_size, [x.dtype for x in (q, k, v, coef, log_lam, g0, b0)], g0.shape)
        return out.to(q.dtype), z.to(q.dtype), g_t, b_t

    @staticmethod
    def backward(ctx, d_o, d_z, d_g, d_b):
        q, k, v, coef, ll, initial, docs, carry = ctx.saved_tensors
        chunk_size, dtypes, g_shape = ctx.meta
        batch, seq_len, heads, feat = q.shape
        n_terms, width = ll.shape[-1], v.shape[-1]
        dev, f32 = q.device, torch.float32

        def given(grad: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev) if grad is None else grad.to(dtype).contiguous()

        d_out, d_zz = given(d_o, v.shape, q.dtype), given(d_z, q.shape[:3], f32)
        chunk, launches = soe_launches(
            batch, seq_len, heads, n_terms, feat, width, chunk_size, q.dtype, device_capability(q)
        )
        n_chunks = triton.cdiv(seq_len, chunk)
        sizes = (seq_len, batch * heads, heads, n_terms, feat, width, initial.shape[-1])
        states = entering_states(launches, k, v, coef, ll, docs, carry, initial, chunk, sizes)
        final = pack(given(d_g, tuple(g_shape), f32), given(d_b, tuple(g_shape[:4]), f32))
        d_states = slots(n_chunks, final, at_end=True)
        launches["bwd_states"].run(q, d_out, coef, d_zz, ll, docs, d_states, *sizes)
        pass_args = (n_chunks, seq_len, chunk, *pass_sizes(states, heads * n_terms))
        launches["bwd_pass"].run(d_states, ll, carry, *pass_args)
        blocks = launches["bwd_intra"].grid[1]  # value blocks
        dq = torch.empty(2 * blocks, *q.shape, dtype=f32, device=dev)  # (cross, intra) x value block
        dk = torch.empty_like(dq)
        dv = torch.empty(2, *v.shape, dtype=f32, device=dev)  # value blocks are disjoint
        dcoef = torch.empty(2 * blocks, *coef.shape, dtype=f32, device=dev)
        dll = torch.empty(3 * blocks * n_chunks * batch, heads, n_terms, dtype=f32, device=dev)  # reads, writes, intra
        centre = (seq_len - 1) / 2.0
        launches["bwd_reads"].run(q, ll, docs, states, d_out, d_zz, dq, dll, *sizes, centre)
        launches["bwd_writes"].run(k, v, coef, ll, docs, d_states, dk, dv, dcoef, dll, *sizes, centre)
        launches["bwd_intra"].run(q, k, v, coef, ll, docs, d_out, d_zz, dq, dk, dv, dcoef, dll, *sizes[:-1])
        # The decay gradient's boundary terms: the final state is read at position T - 1 and the initial
        # state written at -1, each (position - centre) times <state, its gradient>.
        boundary = (states[-1] * d_states[-1] * centre + states[0] * d_states[0] * (centre + 1)).view(
            batch, heads, n_terms, -1
        )
        d_log_lam = dll.sum(0) + boundary.sum((0, 3))
        dg0, db0 = unpack(d_states[0], g_shape)
        grads = (dq.sum(0), dk.sum(0), dv.sum(0), dcoef.sum(0), d_log_lam, dg0, db0)
        return (*(g.to(d) for g, d in zip(grads, dtypes)), None, None)
