"""The scans as ``torch.library`` custom ops, so that ``torch.compile`` keeps them inside one graph.

Dynamo cannot trace the scans' autograd Functions: they call numba-compiled loops on the CPU and Triton
launches on CUDA. Each scan is therefore an opaque op pair to the compiler, ``recurrent::<name>`` (the
forward) and ``recurrent::<name>_backward``, with a fake implementation that gives the output shapes
and an autograd registration that calls the backward op. Both ops run the same autograd Function the
eager path runs (its ``forward`` and ``backward`` called with a stand-in ctx), chosen by the resolved
backend: "torch" is the CPU path (chunked SOE, numba phasor loop), "triton" the CUDA kernels (also CPU
tensors under TRITON_INTERPRET=1). So compiled and eager training compute the same numbers.

The backward op gets the forward's inputs, not what the Function saved (an op's outputs are tensors of
shapes known in advance). A Function with a ``prepare_backward(ctx, *inputs)`` rebuilds its saved
tensors from the inputs without scanning (every CPU path and the phasor kernels); the Triton SOE scan
and its entering-state read have none, and rerun their forward inside the backward op (one more scan
forward per backward, on the compiled path only: eager calls the Functions directly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from kernels._common import work_dtype

OpResult = tuple[Tensor, ...]


class _Ctx:
    """What the scans' autograd Functions use of their ctx, for calling forward and backward outside
    autograd: saved tensors, the input-gradient flags, and any attribute they set."""

    def __init__(self, needs_input_grad: Sequence[bool] = ()) -> None:
        self.needs_input_grad = tuple(needs_input_grad)
        self.saved_tensors: tuple[Tensor | None, ...] = ()

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors

    def set_materialize_grads(self, value: bool) -> None:
        """The Functions all take None for an unused output's gradient; nothing to do."""


def _backward(function: Any, inputs: tuple, grads: tuple, needs: Sequence[bool]) -> tuple:
    """``function``'s input gradients for ``grads``, with its ctx rebuilt from ``inputs``."""
    ctx = _Ctx(needs)
    if hasattr(function, "prepare_backward"):
        function.prepare_backward(ctx, *inputs)
    else:
        function.forward(ctx, *inputs)
    return function.backward(ctx, *grads)


def _filled(grads: tuple, likes: Sequence[Tensor]) -> OpResult:
    """Gradients as op outputs: zeros where the Function returned None, each a fresh tensor (no view of an
    input or of another gradient) of its input's shape and dtype."""
    out = tuple(torch.zeros_like(like, memory_format=torch.contiguous_format) if grad is None else grad.to(like.dtype)
                for grad, like in zip(grads, likes))
    return _fresh(out, likes)


def _aliases(x: Tensor, others: Sequence[Tensor | None]) -> bool:
    """Whether x shares storage with one of ``others`` (an op's output may not alias its inputs)."""
    return any(o is not None and x.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in others)


def _fresh(outputs: tuple, inputs: Sequence[Tensor | None]) -> OpResult:
    """``outputs`` as the fake implementations describe them: contiguous, and none a view of an input or
    of an earlier output (those are copied)."""
    out: list[Tensor] = []
    for x in outputs:
        x = x.contiguous()
        out.append(x.clone() if _aliases(x, [*inputs, *out]) else x)
    return tuple(out)


def _needs(ctx: Any, count: int) -> list[bool]:
    return [bool(n) for n in ctx.needs_input_grad[:count]]


# ----------------------------------------------------------------------------- SOE scan


def _soe_function(backend: str) -> Any:
    if backend == "triton":
        from kernels.soe.triton import SoeScanTriton

        return SoeScanTriton
    from kernels.soe.chunk import SoeScanChunked

    return SoeScanChunked


@torch.library.custom_op("recurrent::soe_scan", mutates_args=())
def soe_scan_op(
    q: Tensor, k: Tensor, v: Tensor, coef: Tensor, log_lam: Tensor, g0: Tensor, b0: Tensor,
    chunk_size: int, reset: Tensor | None, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o, z, final G, final b) of :func:`kernels.soe_scan` from the initial state (g0, b0)."""
    inputs = (q, k, v, coef, log_lam, g0, b0, reset)
    return _fresh(_soe_function(backend).forward(_Ctx(), *inputs[:7], chunk_size, reset), inputs)


@soe_scan_op.register_fake
def _(q, k, v, coef, log_lam, g0, b0, chunk_size, reset, backend):
    batch, seq_len, heads, _ = q.shape
    state = torch.float32 if backend == "triton" else work_dtype(q.dtype)
    return (q.new_empty(batch, seq_len, heads, v.shape[-1]), q.new_empty(batch, seq_len, heads),
            g0.new_empty(g0.shape, dtype=state), b0.new_empty(b0.shape, dtype=state))  # fmt: skip


@torch.library.custom_op("recurrent::soe_scan_backward", mutates_args=())
def soe_scan_backward_op(
    q: Tensor, k: Tensor, v: Tensor, coef: Tensor, log_lam: Tensor, g0: Tensor, b0: Tensor,
    chunk_size: int, reset: Tensor | None, backend: str,
    d_o: Tensor | None, d_z: Tensor | None, d_g: Tensor | None, d_b: Tensor | None, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (q, k, v, coef, log_lam, g0, b0), zeros where ``needs`` is False for q or log_lam."""
    inputs = (q, k, v, coef, log_lam, g0, b0, chunk_size, reset)
    flags = (*needs, False, False)
    grads = _backward(_soe_function(backend), inputs, (d_o, d_z, d_g, d_b), flags)
    return _filled(grads[:7], (q, k, v, coef, log_lam, g0, b0))


@soe_scan_backward_op.register_fake
def _(q, k, v, coef, log_lam, g0, b0, chunk_size, reset, backend, d_o, d_z, d_g, d_b, needs):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, coef, log_lam, g0, b0))


def _soe_setup(ctx, inputs, output) -> None:
    q, k, v, coef, log_lam, g0, b0, chunk_size, reset, backend = inputs
    ctx.save_for_backward(q, k, v, coef, log_lam, g0, b0, reset)
    ctx.chunk_size, ctx.backend = chunk_size, backend


def _soe_backward(ctx, d_o, d_z, d_g, d_b):
    q, k, v, coef, log_lam, g0, b0, reset = ctx.saved_tensors
    needs = _needs(ctx, 7)
    grads = soe_scan_backward_op(q, k, v, coef, log_lam, g0, b0, ctx.chunk_size, reset, ctx.backend,
                                 d_o, d_z, d_g, d_b, needs)  # fmt: skip
    return (*(g if n else None for g, n in zip(grads, needs)), None, None, None)


soe_scan_op.register_autograd(_soe_backward, setup_context=_soe_setup)


# ----------------------------------------------------------------------------- entering state (sequence parallelism)


def _entering_function(backend: str) -> Any:
    if backend == "triton":
        from kernels.soe.triton import SoeEnteringTriton

        return SoeEnteringTriton
    from kernels.parallel import _SoeStateCorrection

    return _SoeStateCorrection


def _entering_args(q, log_lam, g_in, b_in, chunk_size: int, backend: str) -> tuple:
    return (q, log_lam, g_in, b_in) if backend == "triton" else (q, log_lam, g_in, b_in, chunk_size)


@torch.library.custom_op("recurrent::soe_entering", mutates_args=())
def soe_entering_op(
    q: Tensor, log_lam: Tensor, g_in: Tensor, b_in: Tensor, chunk_size: int, backend: str
) -> tuple[Tensor, Tensor]:
    """The (o, z) contributions of a state (g_in, b_in) entering a sequence-parallel piece."""
    args = _entering_args(q, log_lam, g_in, b_in, chunk_size, backend)
    return _fresh(_entering_function(backend).forward(_Ctx(), *args), (q, log_lam, g_in, b_in))


@soe_entering_op.register_fake
def _(q, log_lam, g_in, b_in, chunk_size, backend):
    batch, seq_len, heads, _ = q.shape
    return (q.new_empty(batch, seq_len, heads, g_in.shape[-1], dtype=g_in.dtype),
            q.new_empty(batch, seq_len, heads, dtype=g_in.dtype))  # fmt: skip


@torch.library.custom_op("recurrent::soe_entering_backward", mutates_args=())
def soe_entering_backward_op(
    q: Tensor, log_lam: Tensor, g_in: Tensor, b_in: Tensor, chunk_size: int, backend: str,
    d_o: Tensor | None, d_z: Tensor | None, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (q, log_lam, g_in, b_in)."""
    args = _entering_args(q, log_lam, g_in, b_in, chunk_size, backend)
    if d_o is None:  # the CPU Function takes both gradients (autograd materialises them for it)
        d_o = g_in.new_zeros(*q.shape[:3], g_in.shape[-1])
    if d_z is None:
        d_z = g_in.new_zeros(q.shape[:3])
    grads = _backward(_entering_function(backend), args, (d_o, d_z), (*needs, False))
    return _filled(grads[:4], (q, log_lam, g_in, b_in))


@soe_entering_backward_op.register_fake
def _(q, log_lam, g_in, b_in, chunk_size, backend, d_o, d_z, needs):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, log_lam, g_in, b_in))


def _entering_setup(ctx, inputs, output) -> None:
    q, log_lam, g_in, b_in, chunk_size, backend = inputs
    ctx.save_for_backward(q, log_lam, g_in, b_in)
    ctx.chunk_size, ctx.backend = chunk_size, backend


def _entering_backward(ctx, d_o, d_z):
    needs = _needs(ctx, 4)
    grads = soe_entering_backward_op(*ctx.saved_tensors, ctx.chunk_size, ctx.backend, d_o, d_z, needs)
    return (*(g if n else None for g, n in zip(grads, needs)), None, None)


soe_entering_op.register_autograd(_entering_backward, setup_context=_entering_setup)


# ----------------------------------------------------------------------------- phasor scan


def _phasor_function(backend: str) -> Any:
    if backend == "triton":
        from kernels.phasor.triton import PhasorScanTriton

        return PhasorScanTriton
    from kernels.phasor.compiled import PhasorScanCompiled

    return PhasorScanCompiled


@torch.library.custom_op("recurrent::phasor_scan", mutates_args=())
def phasor_scan_op(
    delta: Tensor, slots: Tensor, n_slots: int, init: Tensor, reset: Tensor | None, backend: str
) -> tuple[Tensor, Tensor]:
    """(read, final phases) of :func:`kernels.phasor_scan` from the phases ``init``."""
    if slots.device.type == "cpu":
        from kernels.phasor.compiled import check_slots

        check_slots(slots, n_slots)
    outputs = _phasor_function(backend).forward(_Ctx(), delta, slots, n_slots, init, reset)
    return _fresh(outputs, (delta, slots, init, reset))


@phasor_scan_op.register_fake
def _(delta, slots, n_slots, init, reset, backend):
    read = torch.empty_like(delta, memory_format=torch.contiguous_format)
    return read, init.new_empty(init.shape, dtype=torch.float32)


@torch.library.custom_op("recurrent::phasor_scan_backward", mutates_args=())
def phasor_scan_backward_op(
    delta: Tensor, slots: Tensor, n_slots: int, init: Tensor, reset: Tensor | None, backend: str,
    d_read: Tensor | None, d_final: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Gradients of (delta, init); ``delta`` is read for its shape, dtype and device only."""
    inputs = (delta, slots, n_slots, init, reset)
    grads = _backward(_phasor_function(backend), inputs, (d_read, d_final), (True, False, False, True, False))
    return _filled((grads[0], grads[3]), (delta, init))


@phasor_scan_backward_op.register_fake
def _(delta, slots, n_slots, init, reset, backend, d_read, d_final):
    return (torch.empty_like(delta, memory_format=torch.contiguous_format),
            torch.empty_like(init, memory_format=torch.contiguous_format))  # fmt: skip


def _phasor_setup(ctx, inputs, output) -> None:
    delta, slots, n_slots, init, reset, backend = inputs
    # the backward reads only delta's shape, dtype and device: a broadcast scalar keeps no [B, T, E, M] alive
    ctx.save_for_backward(delta.new_zeros(()).expand(delta.shape), slots, init, reset)
    ctx.n_slots, ctx.backend = n_slots, backend


def _phasor_backward(ctx, d_read, d_final):
    delta, slots, init, reset = ctx.saved_tensors
    d_delta, d_init = phasor_scan_backward_op(delta, slots, ctx.n_slots, init, reset, ctx.backend, d_read, d_final)
    return d_delta, None, None, d_init, None, None


phasor_scan_op.register_autograd(_phasor_backward, setup_context=_phasor_setup)


def compiling() -> bool:
    """Whether the caller is being traced by torch.compile: the scans then call the custom ops above."""
    return torch.compiler.is_compiling()
