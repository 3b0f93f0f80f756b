"""The SwiGLU gate as one op: silu(gate) * up of a [..., 2H] projection whose first H columns are the gate
(model/blocks.py's SwiGLU), computed in fp32 and returned in the projection's dtype.

Two paths, one meaning:
- "torch" (the CPU path): composite aten ops, differentiated by autograd;
- "triton" (CUDA, or CPU tensors under TRITON_INTERPRET=1): the forward kernel reads the projection once
  and writes the product; the backward kernel reads the projection and the product's gradient and writes
  the projection's gradient whole (kernels/swiglu/triton.py). Composite, the gate is two kernels forward
  and four backward (the two halves' gradients made apart, then concatenated), each moving a tensor of the
  projection's size.

The Triton path is the op ``recurrent::swiglu`` (kernels/library.py's namespace) with its backward op, so that
torch.compile keeps it in its graph; on meta tensors the ops run the kernels' launches as a device does, for
benchmarks/launch_capture.py and the step model to capture them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels._common import resolve_backend
from kernels.library import fused_op


def swiglu(gate_up: Tensor, backend: str = "auto") -> Tensor:
    """silu(gate) * up [..., H] for gate_up [..., 2H] (gate first). ``backend``: "reference" or "torch"
    (composite ops), "triton" or "auto" (Triton for CUDA tensors)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: the projection's last dimension must hold gate and up halves, got "
                         f"{tuple(gate_up.shape)}")
    if resolve_backend(backend, gate_up) in ("reference", "torch"):
        return swiglu_torch(gate_up)
    return swiglu_op(gate_up)


def swiglu_torch(gate_up: Tensor) -> Tensor:
    """The composite gate (the reference the kernels are tested against)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _forward(gate_up: Tensor) -> Tensor:
    from kernels.swiglu.triton import forward

    return forward(gate_up)


def _backward(gate_up: Tensor, dh: Tensor) -> Tensor:
    from kernels.swiglu.triton import backward

    return backward(gate_up, dh)


def _half(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _setup(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _gradients(ctx, backward_op: Any, dh: Tensor) -> Tensor:
    (gate_up,) = ctx.saved_tensors
    return backward_op(gate_up, dh)


swiglu_op = fused_op(
    "swiglu", _forward, "(Tensor gate_up) -> Tensor", _half,
    _backward, "(Tensor gate_up, Tensor dh) -> Tensor",
    lambda gate_up, dh: torch.empty_like(gate_up, memory_format=torch.contiguous_format),
    _setup, _gradients)
