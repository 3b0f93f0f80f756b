"""RMS norm as one op: y = x / sqrt(mean(x^2) + eps) * w over the last dimension, in fp32 whatever x's dtype,
returned in x's dtype (model/blocks.py's RMSNorm).

Two paths, one meaning:
- "torch" (the CPU path): composite aten ops in fp32, differentiated by autograd;
- "triton" (CUDA, or CPU tensors under TRITON_INTERPRET=1): the forward kernel reads x once and writes y;
  the backward kernel reads x and dy and writes dx and per-program shares of dw (kernels/norm/triton.py).
  Composite, one norm is some 7 kernels forward and 15 backward on a GPU, each moving fp32 copies of x
  (fused, a vort-125m eager step at 16,384 tokens went from 171 to 137 ms by benchmarks.predict).

The Triton path is the op ``recurrent::rms_norm`` (kernels/library.py's namespace) with its backward op, so
that torch.compile keeps it in its graph; on meta tensors the ops run the kernels' launches as a device
does, for benchmarks/launch_capture.py and the step model to capture them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kernels._common import resolve_backend
from kernels.library import fused_op


def rms_norm(x: Tensor, weight: Tensor, eps: float, backend: str = "auto") -> Tensor:
    """x [..., D] normalised by its root mean square over D and scaled by ``weight`` [D], in x's dtype.
    ``backend``: "reference" or "torch" (composite ops), "triton" or "auto" (Triton for CUDA tensors)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} for x {tuple(x.shape)}: expected "
                         f"[{x.shape[-1]}]")
    if resolve_backend(backend, x) in ("reference", "torch"):
        return rms_norm_torch(x, weight, eps)
    return rms_norm_op(x, weight, eps)


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The composite norm in fp32 (the reference the kernels are tested against)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def _forward(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from kernels.norm.triton import forward

    return forward(x, weight, eps)


def _backward(x: Tensor, weight: Tensor, dy: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from kernels.norm.triton import backward

    return backward(x, weight, dy, eps)


def _setup(ctx, inputs: tuple, output: Tensor) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _gradients(ctx, backward_op: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    x, weight = ctx.saved_tensors
    dx, dw = backward_op(x, weight, dy, ctx.eps)
    return dx, dw, None


rms_norm_op = fused_op(
    "rms_norm", _forward, "(Tensor x, Tensor weight, float eps) -> Tensor",
    lambda x, weight, eps: torch.empty_like(x, memory_format=torch.contiguous_format),
    _backward, "(Tensor x, Tensor weight, Tensor dy, float eps) -> (Tensor, Tensor)",
    lambda x, weight, dy, eps: (torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)),
    _setup, _gradients)
