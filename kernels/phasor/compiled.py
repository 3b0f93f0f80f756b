"""Compiled sequential phasor scan for CPU tensors (numba), with a hand-written backward.

The scan is a walk over tokens that reads and bumps a few of n_slots running phases. Eager PyTorch has
to express it as sorts and cumsums, each a memory-bound pass over all T * L * M values; compiled, it is
one pass with every slot's phases ([n_slots, M] float64, ~44 KB for PMNet's 85-slot tree) held in the
L1/L2 cache. Phases are kept in float64 and wrapped to [0, 2*pi) after each increment, so precision
does not decay with sequence length; reads are rounded to the input dtype.

The phase columns are independent; the work is split into (batch, block of columns) tasks that run in
parallel on numba's threads (set from torch's intra-op thread count for each call).

Backward: the gradient of an increment is its slot's final-state gradient plus the read gradients of
the slot at later tokens. Two forward passes give it (a walk in reverse token order measured 3-5x
slower on our CPUs): the first sums each slot's final-state and read gradients, which is the initial
state's gradient; the second subtracts the read gradients token by token, and what remains after a
token's own reads is the gradient of its increments. The sums are float64.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kernels._common import use_torch_threads

_TWO_PI = 2.0 * math.pi
_INV_TWO_PI = 1.0 / _TWO_PI


@numba.njit(inline="always")
def _wrap(x: float) -> float:
    return x - _TWO_PI * math.floor(x * _INV_TWO_PI)


def _columns_per_task(batch: int, width: int) -> int:
    """Phase columns per task, so that the batch * ceil(width / columns) tasks cover numba's threads (set
    to torch's count here), with at least 8 columns a task."""
    threads = use_torch_threads()
    blocks = max(1, min(-(-threads // batch), width // 8))
    return -(-width // blocks)


@numba.njit(inline="always")
def _task(task: int, n_blocks: int, step: int, width: int) -> tuple[int, int, int]:
    """Task -> (batch row, first column, end column)."""
    lo = (task % n_blocks) * step
    return task // n_blocks, lo, min(lo + step, width)


@numba.njit(parallel=True, cache=True, nogil=True)
def _forward(delta, slots, init, read, final, step):  # pragma: no cover - compiled
    batch, seq_len, levels, width = delta.shape
    n_blocks = -(-width // step)
    for task in numba.prange(batch * n_blocks):
        b, lo, hi = _task(task, n_blocks, step, width)
        state = np.empty((init.shape[1], hi - lo), dtype=np.float64)
        for n in range(init.shape[1]):
            for m in range(lo, hi):
                state[n, m - lo] = _wrap(np.float64(init[b, n, m]))
        for t in range(seq_len):
            for lvl in range(levels):
                phase = state[slots[b, t, lvl]]
                out = read[b, t, lvl, lo:hi]
                inc = delta[b, t, lvl, lo:hi]
                out[:] = phase
                outside = False
                for m in range(hi - lo):  # one step of 2*pi wraps increments below 2*pi (vectorises)
                    x = phase[m] + inc[m]
                    x = x - _TWO_PI if x >= _TWO_PI else x
                    x = x + _TWO_PI if x < 0.0 else x
                    outside |= (x < 0.0) | (x >= _TWO_PI)
                    phase[m] = x
                if outside:  # a larger increment somewhere in the row
                    for m in range(hi - lo):
                        phase[m] = _wrap(phase[m])
        for n in range(init.shape[1]):
            for m in range(lo, hi):
                final[b, n, m] = state[n, m - lo]


@numba.njit(parallel=True, cache=True, nogil=True)
def _backward(d_read, d_final, slots, d_delta, d_init, step):  # pragma: no cover - compiled
    batch, seq_len, levels, width = d_delta.shape
    n_blocks = -(-width // step)
    for task in numba.prange(batch * n_blocks):
        b, lo, hi = _task(task, n_blocks, step, width)
        # Pass 1: each slot's final-state gradient plus all its read gradients (= the initial state's gradient).
        remaining = np.empty((d_final.shape[1], hi - lo), dtype=np.float64)
        for n in range(d_final.shape[1]):
            for m in range(lo, hi):
                remaining[n, m - lo] = d_final[b, n, m]
        for t in range(seq_len):
            for lvl in range(levels):
                grad = remaining[slots[b, t, lvl]]
                incoming = d_read[b, t, lvl, lo:hi]
                for m in range(hi - lo):
                    grad[m] += incoming[m]
        for n in range(d_final.shape[1]):
            for m in range(lo, hi):
                d_init[b, n, m] = remaining[n, m - lo]
        # Pass 2: an increment's gradient is what remains after the reads up to and including its token.
        for t in range(seq_len):
            for lvl in range(levels):
                grad = remaining[slots[b, t, lvl]]
                incoming = d_read[b, t, lvl, lo:hi]
                out = d_delta[b, t, lvl, lo:hi]
                for m in range(hi - lo):
                    x = grad[m] - incoming[m]
                    grad[m] = x
                    out[m] = x


@numba.njit(parallel=True, cache=True, nogil=True)
def _backward_final_only(d_final, slots, d_delta, d_init, step):  # pragma: no cover - compiled
    batch, seq_len, levels, width = d_delta.shape
    n_blocks = -(-width // step)
    for task in numba.prange(batch * n_blocks):
        b, lo, hi = _task(task, n_blocks, step, width)
        for t in range(seq_len):
            for lvl in range(levels):
                d_delta[b, t, lvl, lo:hi] = d_final[b, slots[b, t, lvl], lo:hi]
        for n in range(d_final.shape[1]):
            for m in range(lo, hi):
                d_init[b, n, m] = d_final[b, n, m]


def _array(x: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """A C-contiguous numpy view of a CPU tensor (converted to ``dtype`` when it differs)."""
    x = x.detach()
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    return x.contiguous().numpy()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class PhasorScanCompiled(torch.autograd.Function):
    """Autograd wrapper: saves only the slot ids; the backward needs no forward activations."""

    @staticmethod
    def forward(ctx, delta, slots, n_slots, init):
        if delta.is_cuda:
            raise RuntimeError("the numba backend runs on CPU tensors; use backend='triton' or 'torch' on CUDA")
        compute = _compute_dtype(delta.dtype)
        step = _columns_per_task(delta.shape[0], delta.shape[-1])
        slot_ids = _array(slots)
        read = torch.empty(delta.shape, dtype=compute)
        final = torch.empty(init.shape, dtype=torch.float64)
        _forward(_array(delta, compute), slot_ids, _array(init), read.numpy(), final.numpy(), step)
        ctx.save_for_backward(slots)
        ctx.meta = (delta.shape, delta.dtype, init.shape, init.dtype)
        ctx.set_materialize_grads(False)
        return read.to(delta.dtype), final.float()

    @staticmethod
    def backward(ctx, d_read, d_final):
        (slots,) = ctx.saved_tensors
        shape, dtype, init_shape, init_dtype = ctx.meta
        step = _columns_per_task(shape[0], shape[-1])
        d_delta = torch.empty(shape, dtype=_compute_dtype(dtype))
        d_init = torch.empty(init_shape, dtype=torch.float64)
        final = np.zeros(init_shape) if d_final is None else _array(d_final, torch.float64)
        if d_read is None:
            _backward_final_only(final, _array(slots), d_delta.numpy(), d_init.numpy(), step)
        else:
            read = _array(d_read, d_delta.dtype)
            _backward(read, final, _array(slots), d_delta.numpy(), d_init.numpy(), step)
        return d_delta.to(dtype), None, None, d_init.to(init_dtype)
