"""The SOE scan's Triton autograd Function: span walks with the state on chip, the pass over span
states, and the gradient walks (kernels/soe/gpu/launches.py lists the launches in the order they run)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton

from kernels._common import check_triton_inputs, device_capability, document_numbers
from kernels.soe.gpu.forward import chunk_output_kernel
from kernels.soe.gpu.launches import key_value_launches, soe_launches, walk_span
from kernels.span import span_carry


def pack(g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(G [B, H, S, F, D], b [B, H, S, F]) -> one fp32 slot [B*H*S, F*D + F] of a packed state."""
    rows, feat = g.shape[0] * g.shape[1] * g.shape[2], g.shape[3]
    return torch.cat((g.float().reshape(rows, -1), b.float().reshape(rows, feat)), 1)


def unpack(slot: torch.Tensor, g_shape: torch.Size | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot [B*H*S, F*D + F] as (G, b) copies with G of shape ``g_shape``."""
    n = g_shape[-2] * g_shape[-1]
    return slot[:, :n].reshape(g_shape).clone(), slot[:, n:].reshape(g_shape[:4]).clone()


def slots(n_spans: int, first: torch.Tensor, at_end: bool) -> torch.Tensor:
    """A packed fp32 buffer [n_spans + 1, B*H*S, W] holding ``first`` in slot 0 (or, ``at_end``, in slot
    n_spans); the span-state walks write every other slot."""
    out = first.new_empty(n_spans + 1, *first.shape)
    out[n_spans if at_end else 0] = first
    return out


def pass_sizes(states: torch.Tensor, terms_per_row: int) -> tuple[int, int, int, int]:
    """The sequence pass's sizes for packed states [n + 1, B*H*S, W]: elements per slot, W, H*S, and
    elements per batch row."""
    width = states.shape[-1]
    return states[0].numel(), width, terms_per_row, terms_per_row * width


def _operands(q, k, v, coef, log_lam, chunk_size: int, reset,
              fast_terms: int) -> tuple[tuple[torch.Tensor, ...], tuple]:  # fmt: skip
    """(q, k, v, coef, log_lam, document numbers) as the kernels read them, with the launches, the span size
    and the chunk of this scan. Without ``reset`` the document numbers are an empty tensor: the chunk-parallel
    kernels then read none (RESETS), and only the span walks' backward makes the zeros it reads."""
    batch, seq_len = q.shape[:2]
    q, k, v = q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
    coef = coef.to(q.dtype).contiguous()
    ll = log_lam.float().contiguous()
    launches, span, chunk = _geometry(q, v, log_lam, chunk_size, fast_terms, reset is not None)
    docs = q.new_empty(0, dtype=torch.int32) if reset is None else document_numbers(reset, batch, seq_len, q.device)
    return (q, k, v, coef, ll, docs), (launches, span, chunk)


def _geometry(q: torch.Tensor, v: torch.Tensor, log_lam: torch.Tensor, chunk_size: int, fast_terms: int = 0,
              resets: bool = True) -> tuple[dict, int, int]:  # fmt: skip
    """The launches, the span size (in chunks) and the chunk of a scan of these operands."""
    batch, seq_len, heads, feat = q.shape
    sizes = (batch, seq_len, heads, log_lam.shape[-1], feat, v.shape[-1])
    capability = device_capability(q)
    chunk, launches = soe_launches(*sizes, chunk_size, q.dtype, capability, fast_terms=fast_terms, resets=resets)
    return launches, walk_span(*sizes, chunk, capability), chunk


def span_states_shape(q: torch.Tensor, v: torch.Tensor, log_lam: torch.Tensor, chunk_size: int) -> tuple[int, ...]:
    """The shape of the packed fp32 states at the span borders that the forward saves for the backward,
    [n_spans + 1, B*H*S, F*D + F] (a fake implementation's output shape, kernels/library.py)."""
    batch, seq_len, heads, feat = q.shape
    _, span, chunk = _geometry(q, v, log_lam, chunk_size)
    return triton.cdiv(seq_len, span * chunk) + 1, batch * heads * log_lam.shape[-1], feat * (v.shape[-1] + 1)


def _sizes(q: torch.Tensor, v: torch.Tensor, ll: torch.Tensor, span: int) -> tuple[int, ...]:
    """The integer arguments the walks take."""
    batch, seq_len, heads, feat = q.shape
    width = v.shape[-1]
    return seq_len, batch * heads, heads, ll.shape[-1], feat, width, feat * (width + 1), span


def _save(ctx, saved: tuple[torch.Tensor, ...], chunk_size: int, fast_terms: int, dtypes: list,
          g_shape: torch.Size) -> None:  # fmt: skip
    """What the backward reads: the operands and span states ``saved``, the chunk size, the fast terms, the
    dtypes of the inputs (q, k, v, coef, log_lam, g0, b0), which their gradients take, and the state's shape."""
    ctx.save_for_backward(*saved)
    ctx.set_materialize_grads(False)
    ctx.meta = (chunk_size, fast_terms, dtypes, g_shape)


def kept_reads_shape(q: torch.Tensor, v: torch.Tensor, log_lam: torch.Tensor, chunk_size: int) -> tuple[int, ...]:
    """The shape of the per-chunk states (the state entering every chunk, in the operands' dtype) that the
    forward keeps for the backward: its buffer for a phase of the chunk kernels, [chunks of the longest
    phase, B*H*S, F*D + F], holding the last phase's (the whole sequence's when its states are within
    launches.KEPT_BYTES, 1.25 GiB; else whole spans within launches.READS_BYTES, 512 MiB), so that the
    chunk-parallel backward, which starts from the last phase, reads them instead of walking those chunks
    again."""
    batch, seq_len, heads, feat = q.shape
    launches, span, chunk = _geometry(q, v, log_lam, chunk_size)
    phases = _phases(launches["fwd"], batch * heads, seq_len, _border_stride(launches, span, chunk))
    return max(n for _c0, n, _launch in phases), batch * heads * log_lam.shape[-1], feat * (v.shape[-1] + 1)


class SoeScanTriton(torch.autograd.Function):
    """Triton forward in chunk-parallel form and backward over spans of chunks (kernels/soe/gpu/launches.py lists
    the launches). The forward's walk stores the state entering every chunk in the operands' dtype for the
    outputs ([chunks of a phase, B*H*S, F*D + F]; the last phase's kept for the chunk-parallel backward,
    :func:`kept_reads_shape`) and the fp32 states at the
    backward's span borders, [n_spans + 1, B*H*S, F*D + F], which it saves for the backward; the backward's
    walks keep their block of every term's state on chip. ``reset`` (bool [B, T] or None) zeroes the state
    before each document's first token: the kernels get the document numbers, the span pass a per-span carry
    (kernels/span.py). No atomics: every output element is stored by one program, in its dtype; the coefficient
    gradient's shares (value blocks and the normalisers) are added in a fixed order by its own kernel and the
    decay gradient's per-span and per-chunk partials by torch, so two runs give bitwise-equal results."""

    @staticmethod
    def forward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size, reset=None, fast_terms=0):
        check_triton_inputs(q, chunk_output_kernel)
        batch, seq_len, heads, _ = q.shape
        dtypes = [x.dtype for x in (q, k, v, coef, log_lam, g0, b0)]
        operands, (launches, span, chunk) = _operands(q, k, v, coef, log_lam, chunk_size, reset, fast_terms)
        q, k, v, coef, ll, docs = operands
        rows = (seq_len, batch * heads, ll.shape[-1])  # the chunk kernels' sizes; the rest are compiled in
        states = slots(triton.cdiv(seq_len, span * chunk), pack(g0, b0), at_end=False)
        out = torch.empty(batch, seq_len, heads, v.shape[-1], dtype=q.dtype, device=q.device)
        z = torch.empty(batch, seq_len, heads, dtype=q.dtype, device=q.device)
        stride = _border_stride(launches, span, chunk)
        phases = _phases(launches["fwd"], batch * heads, seq_len, stride)
        reads = q.new_empty(max(n for _c0, n, _launch in phases), *states.shape[1:])
        for c0, n, phase in phases:
            launches["fwd_states"].run(k, v, coef, ll, docs, reads, states, *rows, stride, c0, n)
            phase.run(q, k, v, coef, ll, docs, reads, out, z, *rows, c0)
        _save(ctx, (*operands, states, reads), chunk_size, fast_terms, dtypes, g0.shape)
        g_t, b_t = unpack(states[-1], g0.shape)
        return out, z, g_t, b_t

    @staticmethod
    def kept(ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """What the backward reads that only the forward's scan makes: the states at span borders and the
        per-chunk states it keeps (:func:`kept_reads_shape`; empty when it keeps none)."""
        return ctx.saved_tensors[-2:]

    @staticmethod
    def prepare_backward(ctx, q, k, v, coef, log_lam, g0, b0, chunk_size, reset, fast_terms, states, reads) -> None:
        """Save what the backward reads, as the forward does, from the inputs and the span and per-chunk
        states that a forward returned (:func:`span_states_shape`, :func:`kept_reads_shape`) without
        scanning again: the torch.library op's backward (kernels/library.py)."""
        operands, _ = _operands(q, k, v, coef, log_lam, chunk_size, reset, fast_terms)
        dtypes = [x.dtype for x in (q, k, v, coef, log_lam, g0, b0)]
        _save(ctx, (*operands, states, reads), chunk_size, fast_terms, dtypes, g0.shape)

    @staticmethod
    def backward(ctx, d_o, d_z, d_g, d_b):
        q, k, v, coef, ll, docs, states, reads = ctx.saved_tensors
        chunk_size, fast_terms, dtypes, g_shape = ctx.meta
        batch, seq_len, heads, feat = q.shape
        n_terms, width = ll.shape[-1], v.shape[-1]
        dev, f32 = q.device, torch.float32

        def given(grad: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev) if grad is None else grad.to(dtype).contiguous()

        d_out, d_zz = given(d_o, v.shape, q.dtype), given(d_z, q.shape[:3], f32)
        capability = device_capability(q)
        decay_grad = ctx.needs_input_grad[4]
        resets = docs.numel() > 0  # the forward saved no document numbers for a scan without resets (_operands)
        chunk, launches = soe_launches(batch, seq_len, heads, n_terms, feat, width, chunk_size, q.dtype, capability,
                                       decay_grad, fast_terms=fast_terms, resets=resets)
        if d_g is None and d_b is None:  # the final state went unused (training without a carried state)
            final = torch.zeros(g_shape[0] * g_shape[1] * g_shape[2], g_shape[3] * (g_shape[4] + 1), dtype=f32,
                                device=dev)
        else:
            final = pack(given(d_g, tuple(g_shape), f32), given(d_b, tuple(g_shape[:4]), f32))
        span = walk_span(batch, seq_len, heads, n_terms, feat, width, chunk, capability)
        if not decay_grad:
            grads = _chunk_grads(launches, (q, k, v, coef, ll, docs), states, reads, d_out, d_zz, final, g_shape,
                                 _border_stride(launches, span, chunk))
            return (*(g if g is None else g.to(d) for g, d in zip(grads, dtypes)), None, None, None)
        if not resets:  # the span walks read zeros
            docs = document_numbers(None, batch, seq_len, dev)
        n_spans = states.shape[0] - 1
        ints = _sizes(q, v, ll, span)
        d_states = slots(n_spans, final, at_end=True)
        launches["bwd_states"].run(q, d_out, d_zz, ll, docs, d_states, *ints)
        pass_args = (n_spans, seq_len, span * chunk, *pass_sizes(d_states, heads * n_terms))
        launches["bwd_pass"].run(d_states, ll, span_carry(docs, span * chunk), *pass_args)
        n_features = triton.cdiv(feat, launches["bwd_keys"].constexprs["BC"])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # the decay gradient's partials (left unwritten without decay_grad): reader sums per feature block and
        # span, writer and intra-chunk sums per chunk
        dll = torch.empty(n_features, n_spans * batch, heads, n_terms, dtype=f32, device=dev)
        n_chunks = triton.cdiv(seq_len, chunk)
        dll_chunks = torch.empty(n_chunks * batch, heads, n_terms, dtype=f32, device=dev)
        centre = (seq_len - 1) / 2.0
        grads_in = (q, k, v, coef, ll, docs)
        launches["bwd_queries"].run(*grads_in, states, d_out, d_zz, dq, dll, *ints, centre)
        dcoef = torch.empty_like(coef)
        # the key and value walks (which make the coefficient gradient's shares [value blocks + 1, B x phase x
        # H, S]) and the coefficient kernel run a phase of spans at a time (launches.phase_spans)
        n_parts = triton.cdiv(width, launches["bwd_values"].constexprs["BD"]) + 1
        phase = launches["bwd_values"].grid[0] // (batch * heads * (n_parts - 1))
        phase_t = phase * span * chunk
        shares = torch.empty(n_parts, batch, phase_t, heads, n_terms, dtype=f32, device=dev)
        for first in range(0, n_spans, phase):
            spans = min(phase, n_spans - first)
            chunks = min(spans * span, n_chunks - first * span)
            keys = dataclasses.replace(launches["bwd_keys"], grid=(spans * batch * heads * (n_features + 1), 1, 1))
            keys.run(*grads_in, d_states, d_out, d_zz, dk, shares, *ints, first, phase_t, n_parts - 1)
            values = dataclasses.replace(launches["bwd_values"], grid=(spans * batch * heads * (n_parts - 1), 1, 1))
            values.run(*grads_in, d_states, d_out, dv, shares, *ints, first, phase_t)
            coefs = dataclasses.replace(launches["bwd_coef"], grid=(chunks * batch * heads, 1, 1))
            coefs.run(*grads_in, d_out, d_zz, shares, dcoef, dll_chunks, *ints[:6], n_parts, first * span, phase_t,
                      centre)  # fmt: skip
        d_log_lam = None
        if decay_grad:
            # boundary terms: the final state is read at position T - 1 and the initial state written at -1,
            # each (position - centre) times <state, its gradient>
            boundary = (states[-1] * d_states[-1] * centre + states[0] * d_states[0] * (centre + 1)).view(
                batch, heads, n_terms, -1
            )
            d_log_lam = (dll.flatten(0, 1).sum(0) + dll_chunks.sum(0) + boundary.sum((0, 3))).to(dtypes[4])
        dg0, db0 = unpack(d_states[0], g_shape)
        grads = (dq, dk, dv, dcoef, d_log_lam, dg0, db0)
        return (*(g if g is None else g.to(d) for g, d in zip(grads, dtypes)), None, None, None)


def _border_stride(launches: dict, span: int, chunk: int) -> int:
    """Forward chunks between two span-border states (a span of ``span`` chunks of ``chunk`` tokens)."""
    return triton.cdiv(span * chunk, launches["fwd"].constexprs["BT"])


def _phases(launch, rows: int, seq_len: int, stride: int) -> list[tuple[int, int, Any]]:
    """(first chunk, chunks, the launch with its grid) of each phase of a chunk-parallel launch whose full
    grid is one phase of chunks x ``rows`` programs (launches.chunk_phase: whole spans of ``stride`` chunks,
    or the whole sequence), first to last. Phases start at span borders, where the forward stores the state
    the backward walks from; a phase of fewer spans than the rest comes first, so that the last phase, whose
    states the forward keeps for the backward, is a full one."""
    per_phase, chunk = launch.grid[0] // rows, launch.constexprs["BT"]
    n_chunks = triton.cdiv(seq_len, chunk)
    if per_phase >= n_chunks:
        starts = [0]
    else:
        n_spans, per_spans = triton.cdiv(n_chunks, stride), per_phase // stride
        first = (n_spans - (triton.cdiv(n_spans, per_spans) - 1) * per_spans) * stride
        starts = [0, *range(first, n_chunks, per_phase)]
    ends = [*starts[1:], n_chunks]
    return [(c0, end - c0, dataclasses.replace(launch, grid=((end - c0) * rows, 1, 1)))
            for c0, end in zip(starts, ends, strict=True)]


def _chunk_grads(launches: dict, inputs: tuple, states: torch.Tensor, kept_reads: torch.Tensor, d_out: torch.Tensor,
                 d_z: torch.Tensor, final: torch.Tensor, g_shape: torch.Size, stride: int) -> tuple:  # fmt: skip
    """(dq, dk, dv, dcoef, None, dG0, db0) by the chunk-parallel backward (kernels/soe/gpu/chunk_grads.py)
    for decays that need no gradient, phase by phase from the last: the states entering the phase's chunks
    (for the last phase ``kept_reads``, the forward's; for the others walked again into a buffer of their
    own from the fp32 state at the phase's start, ``states``: the forward's span borders, ``stride`` chunks
    apart, so that a second backward through a retained graph finds the kept states intact), the gradients
    of the states leaving them walked back from the one leaving the phase (``final`` for the last), then dq and
    (dk, dv, dcoef), each one program per chunk x batch x head."""
    q, k, v, coef, ll, docs = inputs
    batch, seq_len, heads = q.shape[:3]
    rows = (seq_len, batch * heads, ll.shape[-1])  # the chunk kernels' sizes; the rest are compiled in
    dq, dk, dv, dcoef = (torch.empty_like(x) for x in (q, k, v, coef))
    phases = _phases(launches["bwd_chunk_queries"], batch * heads, seq_len, stride)
    d_edges = final.new_empty(len(phases) + 1, *final.shape)  # the state gradients at the phase borders
    d_edges[-1] = final
    d_reads, walked = torch.empty_like(kept_reads), None
    for j, (c0, n, phase) in reversed(list(enumerate(phases))):
        reads = kept_reads
        if j < len(phases) - 1:  # an earlier phase: its states walked again (the kept buffer is left as saved)
            reads = walked = torch.empty_like(kept_reads) if walked is None else walked
            launches["bwd_reads"].run(k, v, coef, ll, docs, reads, states, *rows, stride, c0, n)
        launches["bwd_chunk_states"].run(q, d_out, d_z, ll, docs, d_reads, d_edges[j : j + 2], *rows, c0, n)
        phase.run(*inputs, reads, d_out, d_z, dq, *rows, c0)
        for name in key_value_launches(launches):
            dataclasses.replace(launches[name], grid=phase.grid).run(*inputs, d_reads, d_out, d_z, dk, dv, dcoef,
                                                                     *rows, c0)  # fmt: skip
    dg0, db0 = unpack(d_edges[0], g_shape)
    return dq, dk, dv, dcoef, None, dg0, db0
