"""Compiled sequential phasor scan for CPU tensors (numba), with a hand-written backward.

The scan is the definition run as one pass over the tokens, every slot's phases ([n_slots, M]
float64) held in cache; phases are wrapped to [0, 2*pi) after each increment, so precision does not
decay with sequence length, and reads are rounded to the input dtype. Single-threaded on purpose:
numba's OpenMP pool shares libgomp with torch and resets torch's intra-op thread count. The backward
is two forward passes (docs/kernels.md says why and what they sum); its sums are float64.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kernels._common import TWO_PI, work_dtype

_INV_TWO_PI = 1.0 / TWO_PI


@numba.njit(inline="always")
def _wrap(x: float) -> float:
    return x - TWO_PI * math.floor(x * _INV_TWO_PI)


@numba.njit(cache=True, nogil=True)
def _forward(delta, slots, reset, init, read, final):  # pragma: no cover - compiled
    batch, seq_len, levels, _ = delta.shape
    for b in range(batch):
        phases = np.empty(init.shape[1:], dtype=np.float64)
        for n in range(init.shape[1]):
            for m in range(init.shape[2]):
                phases[n, m] = _wrap(np.float64(init[b, n, m]))
        for t in range(seq_len):
            if reset[b, t]:  # a document starts: every slot back to zero
                phases[:] = 0.0
            for lvl in range(levels):
                phase = phases[slots[b, t, lvl]]
                inc = delta[b, t, lvl]
                read[b, t, lvl] = phase
                outside = False
                for m in range(phase.shape[0]):  # one step of 2*pi wraps increments below 2*pi (vectorises)
                    x = phase[m] + inc[m]
                    x = x - TWO_PI if x >= TWO_PI else x
                    x = x + TWO_PI if x < 0.0 else x
                    outside |= (x < 0.0) | (x >= TWO_PI)
                    phase[m] = x
                if outside:  # a larger increment somewhere in the row
                    for m in range(phase.shape[0]):
                        phase[m] = _wrap(phase[m])
        final[b] = phases


@numba.njit(cache=True, nogil=True)
def _backward(d_read, d_final, slots, reset, d_delta, d_init):  # pragma: no cover - compiled
    batch, seq_len, levels, _ = d_delta.shape
    remaining = np.empty(d_init.shape[1:], dtype=np.float64)
    for b in range(batch):
        d_init[b] = 0.0  # set below by the first document unless a reset drops the initial state at once
        if seq_len == 0:
            d_init[b] = d_final[b]
        start = 0
        while start < seq_len:  # one document [start, stop) at a time
            stop = start + 1
            while stop < seq_len and not reset[b, stop]:
                stop += 1
            # Pass 1: each slot's final-state gradient (the row's last document only) plus all its read
            # gradients in the document (the first document's: the initial state's gradient).
            remaining[:] = 0.0
            if stop == seq_len:
                remaining[:] = d_final[b]
            for t in range(start, stop):
                for lvl in range(levels):
                    grad = remaining[slots[b, t, lvl]]
                    incoming = d_read[b, t, lvl]
                    for m in range(grad.shape[0]):
                        grad[m] += incoming[m]
            if start == 0 and not reset[b, 0]:
                d_init[b] = remaining
            # Pass 2: an increment's gradient is what remains after the reads up to and including its token.
            for t in range(start, stop):
                for lvl in range(levels):
                    grad = remaining[slots[b, t, lvl]]
                    incoming = d_read[b, t, lvl]
                    out = d_delta[b, t, lvl]
                    for m in range(grad.shape[0]):
                        x = grad[m] - incoming[m]
                        grad[m] = x
                        out[m] = x
            start = stop


@numba.njit(cache=True, nogil=True)
def _backward_final_only(d_final, slots, reset, d_delta, d_init):  # pragma: no cover - compiled
    batch, seq_len, levels, _ = d_delta.shape
    for b in range(batch):
        last = -1  # the row's last reset (only increments from there on reach the final state)
        for t in range(seq_len):
            if reset[b, t]:
                last = t
        for t in range(seq_len):
            for lvl in range(levels):
                if t >= last:
                    d_delta[b, t, lvl] = d_final[b, slots[b, t, lvl]]
                else:
                    d_delta[b, t, lvl] = 0.0
        d_init[b] = 0.0
        if last < 0:
            d_init[b] = d_final[b]


def _array(x: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """A C-contiguous numpy view of a CPU tensor (converted to ``dtype`` when it differs)."""
    x = x.detach()
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    return x.contiguous().numpy()


def _starts(reset: torch.Tensor | None, shape: torch.Size) -> np.ndarray:
    """The document starts as a bool [B, T] array (all false without resets)."""
    return np.zeros(shape[:2], dtype=np.bool_) if reset is None else _array(reset)


def check_slots(slots: torch.Tensor, n_slots: int) -> None:
    """Slot ids [B, T, L] of CPU tensors in [0, n_slots), disjoint across the levels of a token: the
    compiled loops index with them unchecked. Reads the ids through numpy, so CPU tensors only."""
    ids = _array(slots)
    if not ids.size:
        return
    if ids.min() < 0 or ids.max() >= n_slots:
        raise ValueError(f"slot ids must lie in [0, {n_slots})")
    levels = ids.shape[-1]
    if any((ids[..., i] == ids[..., j]).any() for i in range(levels) for j in range(i + 1, levels)):
        raise ValueError("two levels of one token share a slot; levels must use disjoint slot ids")


class PhasorScanCompiled(torch.autograd.Function):
    """Autograd wrapper: saves only the slot ids and the resets; the backward needs no forward activations.
    ``reset`` (bool [B, T] or None) zeroes every slot before a document's first token reads."""

    @staticmethod
    def prepare_backward(ctx, delta, slots, n_slots, init, reset=None) -> None:
        """Save what the backward reads (the slot ids and resets, and the shapes) without scanning."""
        ctx.save_for_backward(slots, reset)
        ctx.meta = (delta.shape, delta.dtype, init.shape, init.dtype)
        ctx.set_materialize_grads(False)

    @staticmethod
    def forward(ctx, delta, slots, n_slots, init, reset=None):
        compute = work_dtype(delta.dtype)
        slot_ids = _array(slots)
        read = torch.empty(delta.shape, dtype=compute)
        final = torch.empty(init.shape, dtype=torch.float64)
        starts = _starts(reset, delta.shape)
        _forward(_array(delta, compute), slot_ids, starts, _array(init), read.numpy(), final.numpy())
        PhasorScanCompiled.prepare_backward(ctx, delta, slots, n_slots, init, reset)
        return read.to(delta.dtype), final.float()

    @staticmethod
    def backward(ctx, d_read, d_final):
        slots, reset = ctx.saved_tensors
        shape, dtype, init_shape, init_dtype = ctx.meta
        starts = _starts(reset, shape)
        d_delta = torch.empty(shape, dtype=work_dtype(dtype))
        d_init = torch.empty(init_shape, dtype=torch.float64)
        final = np.zeros(init_shape) if d_final is None else _array(d_final, torch.float64)
        if d_read is None:
            _backward_final_only(final, _array(slots), starts, d_delta.numpy(), d_init.numpy())
        else:
            read = _array(d_read, d_delta.dtype)
            _backward(read, final, _array(slots), starts, d_delta.numpy(), d_init.numpy())
        return d_delta.to(dtype), None, None, d_init.to(init_dtype), None
