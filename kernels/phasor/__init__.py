"""The phasor scan: public entry point and backend dispatch."""

from __future__ import annotations

import torch

from kernels._common import BACKENDS, resolve_backend, use_ops
from kernels.phasor.compiled import PhasorScanCompiled, check_slots
from kernels.phasor.naive import phasor_scan_reference
from kernels.phasor.op import phasor_scan_op
from kernels.phasor.segment import PhasorScanSegmented

PHASOR_BACKENDS = (*BACKENDS, "segmented")


def phasor_scan(
    delta: torch.Tensor,
    slots: torch.Tensor,
    n_slots: int,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "auto",
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-slot running phase sums (PMNet's memory read/write).

    delta [B, T, L, M] are phase increments, slots [B, T, L] integer slot ids in [0, n_slots) (levels
    of one token never share a slot), initial_state [B, n_slots, M]. Returns read [B, T, L, M]: the phase
    of slot slots[b,t,l] before token t writes, i.e. wrap(init + increments from tokens j < t), and, if
    ``output_final_state``, the fp32 final phases [B, n_slots, M]. wrap maps to [0, 2*pi) and counts as
    the identity for gradients. Differentiable in delta and initial_state.

    ``backend``: "reference" (sequential, float64-capable); "torch" (the CPU default: a numba-compiled
    sequential loop on CPU tensors, the "segmented" form on other devices); "segmented" (cumsums over
    slot-sorted entries in PyTorch, any device); "triton" (the CUDA default); or "auto".

    ``reset`` (bool [B, T], optional): True where a token starts a document. Before that token reads,
    every slot of its row goes back to zero, a document's own initial phases: the increments before it
    and ``initial_state`` (a state carried from earlier text) are forgotten, as :func:`kernels.soe_scan`
    forgets its state at a reset, so each document is scanned as if alone; the final phases are the
    increments of the row's last document. Every backend honours it, forward and backward.
    """
    if delta.dim() != 4 or slots.shape != delta.shape[:3]:
        raise ValueError(
            f"delta must be [B, T, L, M] and slots [B, T, L]; got {tuple(delta.shape)}, {tuple(slots.shape)}"
        )
    if slots.dtype.is_floating_point:
        raise ValueError("slots must be an integer tensor")
    batch, seq_len, _, width = delta.shape
    if reset is not None and (reset.shape != (batch, seq_len) or reset.dtype != torch.bool):
        raise ValueError(f"reset must be bool [B, T] = {(batch, seq_len)}, got {reset.dtype} {tuple(reset.shape)}")
    if initial_state is not None and initial_state.shape != (batch, n_slots, width):
        raise ValueError(f"initial_state must be [B, n_slots, M] = {(batch, n_slots, width)}")
    if slots.device.type == "cpu" and not use_ops():  # a host-side check would stall a GPU stream (and meta
        check_slots(slots, n_slots)  # has no values); the custom op checks its CPU inputs itself
    which = resolve_backend(backend, delta, PHASOR_BACKENDS)
    if which == "reference":
        return phasor_scan_reference(delta, slots, n_slots, initial_state, output_final_state, reset)
    init = initial_state if initial_state is not None else delta.new_zeros(batch, n_slots, width, dtype=torch.float32)
    if use_ops() and (which == "triton" or (which == "torch" and delta.device.type == "cpu")):
        read, final = phasor_scan_op(delta, slots, n_slots, init, reset, which)
        return read, (final if output_final_state else None)
    if which == "triton":
        from kernels.phasor.triton import PhasorScanTriton

        fn = PhasorScanTriton
    elif which == "torch" and delta.device.type == "cpu":
        fn = PhasorScanCompiled
    else:
        fn = PhasorScanSegmented
    read, final = fn.apply(delta, slots, n_slots, init, reset)
    return read, (final if output_final_state else None)


def slot_phases(state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The phases [B, T, L, M] of the slots ``slots`` [B, T, L] read in ``state`` [B, n_slots, M]."""
    batch, seq_len, levels = slots.shape
    index = slots.long().reshape(batch, seq_len * levels, 1).expand(-1, -1, state.shape[-1])
    return state.gather(1, index).view(batch, seq_len, levels, -1)

