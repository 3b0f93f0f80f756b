"""The phasor scan as the custom op ``recurrent::phasor_scan`` (kernels/library.py), which torch.compile
keeps in its graph: the numba loop on CPU tensors or the Triton kernels by backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kernels.library import scan_op
from kernels.phasor.compiled import PhasorScanCompiled, check_slots


def _function(backend: str) -> Any:
    if backend == "triton":
        from kernels.phasor.triton import PhasorScanTriton

        return PhasorScanTriton
    return PhasorScanCompiled


def _fake(delta, slots, n_slots, init, reset, backend) -> tuple[Tensor, Tensor]:
    """(read, final phases)."""
    read = torch.empty_like(delta, memory_format=torch.contiguous_format)
    return read, init.new_empty(init.shape, dtype=torch.float32)


def _check(delta, slots, n_slots, init, reset) -> None:
    """Slot ids in range, checked on the host for CPU tensors only (a GPU stream would stall)."""
    if slots.device.type == "cpu":
        check_slots(slots, n_slots)


phasor_scan_op = scan_op(
    "phasor_scan", "Tensor delta, Tensor slots, int n_slots, Tensor init, Tensor? reset", _function, _fake,
    outputs=2, differentiable=(0, 3), shape_only=(0,), check=_check,
)
"""(read, final phases) of :func:`kernels.phasor_scan` from the phases ``init``."""
