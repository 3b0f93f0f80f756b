"""Positive random features of normalised vectors, as one op: VORT's feature map of its queries and keys.

    phi(x) = exp(W y - |y|^2 / 2) / sqrt(F),   y = s r / max(|r|, eps),   r = R x
    (per head: W [F, D], s a number, R the rotary rotation of x's position, or none)

so that E[phi(q) . phi(k)] = exp(s^2 cos(q, k)) for W with N(0, I) rows (model/vort.py draws them).

Two paths, one meaning:
- "torch" (the CPU path, and the only one for a learned W or s): composite aten ops in the work dtype
  (kernels.work_dtype: fp32 for 16-bit inputs), differentiated by autograd;
- "triton" (CUDA, or CPU tensors under TRITON_INTERPRET=1): the forward kernel reads x (and the rotary
  tables) once and writes phi in x's dtype; the backward kernel reads x and dphi, recomputes phi and writes
  dx. The rotation, the norm, the projection and the exponential stay in fp32 in registers; the projection
  runs on the tensor cores in tf32 for 16-bit inputs (its 10-bit mantissa puts an error of about |W y| x 5e-4
  in the exponent, of the order of the bf16 rounding of the phi it feeds: tests/test_features.py) and in full
  fp32 for fp32 inputs. Composite, the same map moves x and several fp32 intermediates of its size through
  memory, forward and backward.
  Fixed W and s only (VORT's shipped settings): the kernels differentiate x alone.

The Triton path is the op ``recurrent::positive_features`` (kernels/library.py's namespace) with its
backward op, so that torch.compile keeps it in its graph; on meta tensors the ops run the kernels' launches
as a device does, for benchmarks/launch_capture.py and the step model to capture them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels._common import resolve_backend, work_dtype
from kernels.library import fused_op

EPS = 1e-12  # F.normalize's floor on the norm


def positive_features(x: Tensor, weight: Tensor, scale: float | Tensor, cos: Tensor | None = None,
                      sin: Tensor | None = None, backend: str = "auto") -> Tensor:
    """phi(x) [..., H, F] of x [..., H, D] for per-head projections ``weight`` [H, F, D] and ``scale`` (a
    number, or [H, 1] per head); with ``cos`` and ``sin`` (the rotary tables, [T, D/2] shared by the rows
    or [B, T, D/2]; x then [B, T, H, D]) x is first rotated (`rotate`). The torch path returns the work
    dtype, the Triton path x's dtype. ``backend``: "reference" or "torch" (composite ops), "triton" or
    "auto" (Triton for CUDA tensors); a W or scale that needs a gradient takes the composite ops on every
    backend."""
    if cos is not None and (x.dim() != 4 or x.shape[-1] % 2 or cos.shape[-2:] != (x.shape[1], x.shape[-1] // 2)):
        raise ValueError(f"rotary tables of shape {tuple(cos.shape)} do not fit x {tuple(x.shape)}: expected "
                         f"[T, D/2] or [B, T, D/2] for x [B, T, H, D] with D even")
    learned = weight.requires_grad or isinstance(scale, Tensor)
    if learned or x.shape[-1] % 2 or resolve_backend(backend, x) in ("reference", "torch"):
        return features_torch(x, weight, scale, cos, sin)
    return positive_features_op(x, weight, float(scale), cos, sin)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the column pairs (x[..., :D/2], x[..., D/2:]) of x [B, T, H, D] by the angles whose cos and sin
    are given ([T, D/2] shared by the rows, or [B, T, D/2]), in x's dtype: the rotary position embedding."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[..., None, :], sin[..., None, :]
    if cos.dim() == 3:
        cos, sin = cos[None], sin[None]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def features_torch(x: Tensor, weight: Tensor, scale: float | Tensor, cos: Tensor | None = None,
                   sin: Tensor | None = None) -> Tensor:
    """The composite map in the work dtype (the reference the kernels are tested against)."""
    dt = work_dtype(x.dtype)
    x = x.to(dt) if cos is None else rotate(x.to(dt), cos.to(dt), sin.to(dt))
    y = F.normalize(x, dim=-1, eps=EPS) * scale
    proj = torch.einsum("...hd,hfd->...hf", y, weight.to(dt))
    return torch.exp(proj - 0.5 * y.pow(2).sum(-1, keepdim=True)) * weight.shape[1] ** -0.5


def _forward(x: Tensor, weight: Tensor, scale: float, cos: Tensor | None, sin: Tensor | None) -> Tensor:
    from kernels.features.triton import forward

    return forward(x, weight, scale, cos, sin, EPS)


def _backward(x: Tensor, weight: Tensor, d_phi: Tensor, scale: float, cos: Tensor | None, sin: Tensor | None) -> Tensor:
    from kernels.features.triton import backward

    return backward(x, weight, d_phi, scale, cos, sin, EPS)


def _setup(ctx, inputs: tuple, output: Tensor) -> None:
    x, weight, scale, cos, sin = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.scale = scale


def _gradients(ctx, backward_op: Any, d_phi: Tensor) -> tuple[Tensor | None, None, None, None, None]:
    x, weight, cos, sin = ctx.saved_tensors
    return backward_op(x, weight, d_phi, ctx.scale, cos, sin), None, None, None, None


positive_features_op = fused_op(
    "positive_features", _forward, "(Tensor x, Tensor weight, float scale, Tensor? cos, Tensor? sin) -> Tensor",
    lambda x, weight, scale, cos, sin: x.new_empty(*x.shape[:-1], weight.shape[1]),
    _backward, "(Tensor x, Tensor weight, Tensor d_phi, float scale, Tensor? cos, Tensor? sin) -> Tensor",
    lambda x, weight, d_phi, scale, cos, sin: torch.empty_like(x, memory_format=torch.contiguous_format),
    _setup, _gradients)
