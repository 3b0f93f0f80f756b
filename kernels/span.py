"""Spans: how the Triton scans split one long sequence over many programs (both scans use it).

A scan that walks its chunks in order in one program per (head, term, value block) or (batch, block of
phase columns) launches too few programs at batch 1 to fill a GPU. The Triton kernels therefore cut the
sequence into spans of whole chunks and run in three steps, as flash-linear-attention's chunk kernels do:

1. per span, in parallel: the span's own contribution to the state (what its tokens add, from a zero state);
2. one light pass over the spans (``_span_pass_kernel``, parallel over the state's elements): each span's
   entering state from the previous one's, ``x_{i+1} = decay_i * x_i + contribution_i`` (a decayed prefix
   sum for SOE terms, a plain prefix sum of phases for the phasor scan), or in reverse order for the
   state gradients of the backward;
3. per span, in parallel: the outputs (or the input gradients) from the entering state, the old
   sequential walk restricted to the span.

Document resets (``reset`` bool [B, T]) cut all three steps: the kernels get each token's document number
(:func:`document_numbers`) and zero the state at a document start (:func:`chunk_documents`), and the pass
lets a span's entering state through only when the span has no reset (:func:`span_carry`).

The number of spans is chosen from the grid, not from the length: enough spans that the per-span kernels
launch at least ``TARGET_PROGRAMS`` programs, and no more, so the states kept per span stay a few MB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import INT32_ELEMENTS, Launch

MIN_PROGRAMS = 132  # one per H100 SM: every kernel of a training step launches at least this many
TARGET_PROGRAMS = 2 * MIN_PROGRAMS  # what the per-span kernels aim for: two programs per SM
MAX_PASS_BLOCK = 1024  # state elements per program of the span pass


def span_chunks(seq_len: int, chunk: int, programs_per_span: int) -> int:
    """Chunks of ``chunk`` tokens per span: the most that still gives ``TARGET_PROGRAMS`` programs to a
    kernel launching ``programs_per_span`` programs per span (one chunk per span when the sequence is
    too short for that)."""
    need = triton.cdiv(TARGET_PROGRAMS, programs_per_span)
    return max(1, triton.cdiv(seq_len, chunk) // need)


def span_carry(docs: torch.Tensor, span: int) -> torch.Tensor:
    """fp32 [B, n_spans] from document numbers [B, T]: 1 where a span of ``span`` tokens has no reset (the
    state entering it reaches its end), 0 where it has one (the span pass then drops that state)."""
    seq_len = docs.shape[1]
    first = torch.arange(0, seq_len, span, device=docs.device)
    last = (first + span).clamp(max=seq_len) - 1
    before = torch.where(first > 0, docs[:, (first - 1).clamp(min=0)], 0)
    return (docs[:, last] == before).float().contiguous()


@triton.jit
def chunk_start(lo, i, n_chunks, BT: tl.constexpr, REVERSE: tl.constexpr):
    """First token of the i-th of the ``n_chunks`` chunks a span from ``lo`` walks: in token order, or in
    reverse order (REVERSE)."""
    if REVERSE:
        i = n_chunks - 1 - i
    return lo + i * BT


@triton.jit
def chunk_documents(docs, row, start, seq_len, BT: tl.constexpr):
    """Document numbers (:func:`document_numbers`, [B, T] int32) of the chunk of BT tokens at ``start`` in
    batch row ``row``: per token [BT] (-1 past the end), of the state entering the chunk (the token before
    it; 0 before the first token) and of the chunk's last token. A token reads the entering state only if
    its number equals the entering one, writes the leaving state only if it equals the last one, and the
    entering state passes through the chunk only if the two are equal."""
    offs = start + tl.arange(0, BT)
    row_docs = docs + row * seq_len
    doc = tl.load(row_docs + offs, mask=offs < seq_len, other=-1)
    entering = tl.where(start > 0, tl.load(row_docs + tl.maximum(start - 1, 0)), 0)
    last = tl.load(row_docs + tl.minimum(start + BT, seq_len) - 1)
    return doc, entering, last


@triton.jit
def wrap_phase(x):
    """x mod 2*pi in [0, 2*pi). 2*pi is subtracted in two parts (Cody-Waite): k times its fp32 value,
    then k times the rest (-1.748e-7), so a phase that wraps again and again does not drift by fp32's
    rounding of 2*pi, which a single constant adds at every wrap."""
    k = tl.floor(x * 0.15915494309189535)
    y = (x - k * 6.2831854820251465) - k * -1.7484555314695172e-07
    y = tl.where(y < 0.0, y + 6.283185307179586, y)
    return tl.where(y >= 6.283185307179586, y - 6.283185307179586, y)


@triton.jit
def _span_pass_kernel(
    states,
    log_lam,
    carry,
    n_spans,
    seq_len,
    SPAN,
    N,
    W,
    HS,
    ROW,
    REVERSE: tl.constexpr,
    DECAY: tl.constexpr,
    WRAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``states`` [n_spans + 1, N]. Forward: slot 0 holds the initial state and slot i + 1 span i's
    contribution; afterwards slot i holds the state entering span i and slot n_spans the final state.
    REVERSE: slot n_spans holds the final state's gradient and slot i span i's contribution; afterwards
    slot i holds the gradient of the state entering span i (slot 0: the initial state's). With DECAY,
    element e belongs to SOE term ``(e // W) % HS`` and a span of n tokens multiplies it by lam^n; with
    WRAP, states are phases kept in [0, 2*pi). Element e belongs to batch row ``e // ROW``, and ``carry``
    [B, n_spans] (:func:`span_carry`) multiplies the state passing through a span: 0 where the span holds
    a reset of that row (its contribution then starts at its last reset, or, reversed, ends before its
    first)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    stride = tl.zeros([BLOCK], dtype=tl.int64) + N  # slot offsets in 64 bits
    if DECAY:
        ll = tl.load(log_lam + (offs // W) % HS, mask=mask, other=0.0)
    row_carry = carry + (offs // ROW) * n_spans
    if REVERSE:
        x = tl.load(states + n_spans * stride + offs, mask=mask, other=0.0)
    else:
        x = tl.load(states + offs, mask=mask, other=0.0)
    for i in range(0, n_spans):
        if REVERSE:
            span = n_spans - 1 - i
            slot = span
        else:
            span = i
            slot = i + 1
        if DECAY:
            x = x * tl.exp(tl.minimum(SPAN, seq_len - span * SPAN).to(tl.float32) * ll)
        x = x * tl.load(row_carry + span, mask=mask, other=0.0)
        ptr = states + slot * stride + offs
        x += tl.load(ptr, mask=mask, other=0.0)
        if WRAP:
            x = wrap_phase(x)
        tl.store(ptr, x, mask=mask)


def span_pass_launch(n_elements: int, reverse: bool, decay: bool, wrap: bool) -> Launch:
    """The span pass over a state of ``n_elements`` fp32 values (the grid does not depend on the length:
    the pass loops over the spans). Blocks of up to MAX_PASS_BLOCK elements, smaller for small states so
    that the pass still launches MIN_PROGRAMS programs (a power of two, at least 2). Slots are addressed
    with 64-bit offsets, so ``states`` may hold any number of slots; offsets inside a slot are int32."""
    if n_elements > INT32_ELEMENTS:
        raise ValueError(f"span pass: one state slot of {n_elements:,} elements is over the {INT32_ELEMENTS:,} "
                         "that its int32 offsets reach; use a smaller batch per rank")
    block = max(2, min(MAX_PASS_BLOCK, 1 << max(0, (n_elements // MIN_PROGRAMS).bit_length() - 1)))
    return Launch(
        _span_pass_kernel,
        {"states": "fp32", "log_lam": "fp32", "carry": "fp32"},
        dict.fromkeys(("n_spans", "seq_len", "SPAN", "N", "W", "HS", "ROW"), "i32"),
        {"REVERSE": reverse, "DECAY": decay, "WRAP": wrap, "BLOCK": block},
        (triton.cdiv(n_elements, block),),
        max(1, min(4, block // 256)),
        1,
        wide=frozenset({"states"}),
    )
